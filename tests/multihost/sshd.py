"""SSH into namespace hosts, for `ray up` with the local provider.

Each host gets its own sshd listening on the host's address only, with host and user keys made
here in a temp dir, and a private home: `ray up` writes ~/ray_bootstrap_*, ~/.ray/auth_token and
~/.bashrc on every node, and the hosts share the machine's /root. The private home is a bind
mount in the host's own mount namespace (the Python install under /root/.pyenv is bound into
it), and so is a private /tmp/ray (Ray's default temp dir, which `ray start` in the cluster
YAML uses): nothing of it is visible outside the host.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.multihost.netns import Host, Network, run

SSHD = "/usr/sbin/sshd"
PYENV = Path("/root/.pyenv")

_SSHD_CONFIG = """\
ListenAddress {ip}
Port 22
HostKey {host_key}
PidFile {dir}/sshd.pid
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
Subsystem sftp internal-sftp
"""


def make_keys(dir_: Path) -> tuple[Path, Path]:
    """A host key and a user key pair (no passphrase); returns (host_key, user_key)."""
    dir_.mkdir(parents=True, exist_ok=True)
    host_key, user_key = dir_ / "ssh_host_ed25519_key", dir_ / "id_ed25519"
    for key in (host_key, user_key):
        if not key.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
    (dir_ / "authorized_keys").write_text(user_key.with_suffix(".pub").read_text())
    user_key.chmod(0o600)
    return host_key, user_key


def private_home(host: Host) -> Path:
    """Bind a private /root (with the Python install bound in) and /tmp/ray into the host."""
    home, ray_tmp = host.temp_dir / "home", host.temp_dir / "ray-tmp"
    (home / ".pyenv").mkdir(parents=True, exist_ok=True)
    ray_tmp.mkdir(parents=True, exist_ok=True)
    Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point; the host sees its own copy
    bindir = Path(sys.executable).parent
    rc = f"export PATH={bindir}:$PATH\nexport PYENV_ROOT={PYENV}\n"
    (home / ".bashrc").write_text(rc)
    (home / ".profile").write_text(". ~/.bashrc\n")
    for cmd in (["mount", "--rbind", str(PYENV), str(home / ".pyenv")],
                ["mount", "--rbind", str(home), "/root"],
                ["mount", "--bind", str(ray_tmp), "/tmp/ray"]):
        run(host.argv(*cmd))
    return home


def ssh(user_key: Path, host: Host, command: str, timeout: float = 60.0
        ) -> subprocess.CompletedProcess:
    """Run ``command`` in a login shell on ``host`` as root, as `ray up` does (its PATH, token)."""
    return run(["ssh", "-i", str(user_key), "-o", "BatchMode=yes", "-o",
                "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
                "ConnectTimeout=3", "-o", "LogLevel=ERROR", f"root@{host.ip}",
                f"bash --login -c {shlex.quote(command)}"], check=False, timeout=timeout)


def start_sshd(net: Network, host: Host, keys_dir: Path, logs: Path) -> subprocess.Popen:
    """sshd inside ``host`` on its address, port 22; returns once it accepts connections."""
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    config = host.temp_dir / "sshd_config"
    config.write_text(_SSHD_CONFIG.format(ip=host.ip, host_key=keys_dir / "ssh_host_ed25519_key",
                                          dir=host.temp_dir,
                                          authorized=keys_dir / "authorized_keys"))
    proc = net.spawn(host, [SSHD, "-D", "-e", "-f", str(config)], logs / f"sshd-{host.name}.log")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        probe = ssh(keys_dir / "id_ed25519", host, "echo ok", timeout=10)
        if probe.stdout.strip() == "ok":
            return proc
        time.sleep(0.3)
    raise RuntimeError(f"sshd on {host.name} ({host.ip}) does not answer: {probe.stderr}")
