"""Ray, Redis and kvstore on namespace hosts: the steps the multi-host tests are made of.

The kvstore steps are small functions over the CLI contract (`kvstore start/status/generate`),
switched on by `kvstore_cli_ready()` so the harness itself is proven with plain Ray first.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.multihost.netns import Host, Network

RAY_PORT = 6379  # the GCS keeps its conventional port: each host has its own port space
DASHBOARD_PORT = 8265
REDIS_PORT = 6380

# Placement tags: prefill replicas go to h1, decode replicas to h2 (the `prefill` and `decode`
# resources of deploy/cluster-aws.yaml and the KubeRay worker groups).
ROLE_RESOURCES = {"h1": {"prefill": 1}, "h2": {"decode": 1}}

# Short health checks so a cut link or a killed host is declared dead in seconds, not 30+.
HEALTH_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass(slots=True)
class RayCluster:
    """A Ray head on hosts[0] and workers on the others, all with one auth token."""

    net: Network
    token: str
    redis_password: str
    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    redis: subprocess.Popen | None = None
    prober: Prober | None = None  # the session's probe driver, once kvstore runs

    @property
    def head(self) -> Host:
        """The head host (GCS, dashboard/job server, Redis)."""
        return self.net.hosts[0]

    @property
    def gcs_address(self) -> str:
        """host:port of the GCS, as workers and drivers dial it."""
        return f"{self.head.ip}:{RAY_PORT}"

    @property
    def dashboard_url(self) -> str:
        """The job server's address for `ray job submit --address`."""
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    @property
    def redis_url(self) -> str:
        """The private Redis (index) on the head: TLS, its password kept out of the URL."""
        return f"rediss://{self.head.ip}:{REDIS_PORT}/0"

    @property
    def secrets_dir(self) -> Path:
        """The head's kvstore secrets directory (``kvstore start`` and ``credentials``)."""
        return Path(self.env["KVSTORE_SECURITY_SECRETS_DIR"])

    @property
    def redis_conf(self) -> Path:
        """The redis.conf include ``kvstore credentials redis-conf`` wrote (0600)."""
        return self.head.temp_dir / "redis.conf"


def make_env(token: str) -> dict[str, str]:
    """The environment every Ray process gets: token auth on, short health checks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HEALTH_ENV)
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"})
    return env


def ray_start_argv(cluster: RayCluster, host: Host) -> list[str]:
    """`ray start --block` for this host: head on hosts[0], worker elsewhere; explicit ports."""
    common = ["--node-ip-address", host.ip, "--num-cpus", "2", "--object-store-memory",
              str(80 << 20), "--temp-dir", str(host.temp_dir / "ray"),
              "--resources", json.dumps({f"host_{host.name}": 1,
                                         **ROLE_RESOURCES.get(host.name, {})}), "--block"]
    if host is cluster.head:
        return ["ray", "start", "--head", "--port", str(RAY_PORT), "--dashboard-host", host.ip,
                "--dashboard-port", str(DASHBOARD_PORT), "--include-dashboard", "true",
                "--disable-usage-stats", *common]
    return ["ray", "start", "--address", cluster.gcs_address, *common]


def start_node(cluster: RayCluster, host: Host) -> subprocess.Popen:
    """Start Ray on one host (used at boot and to bring a killed host back)."""
    return cluster.net.spawn(host, ray_start_argv(cluster, host),
                             cluster.logs / f"ray-{host.name}.log", env=cluster.env)


def prepare_redis(cluster: RayCluster) -> None:
    """As the deploy docs do on the head: ``kvstore credentials redis-conf`` makes the cluster
    secrets, a Redis password and a certificate from the cluster CA, in a 0600 include; the
    password never goes into any argv."""
    proc = in_host(cluster, cluster.head, "kvstore", "credentials", "redis-conf", "--out",
                   str(cluster.redis_conf), "--tls-host", cluster.head.ip, "127.0.0.1",
                   "--port", str(REDIS_PORT), timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kvstore credentials redis-conf failed: {proc.stderr[-2000:]}")
    cluster.redis_password = (cluster.secrets_dir / "redis_password").read_text().strip()


#: Starts of a restarted Redis, each given 2 s to keep running (``restart_redis``).
REDIS_START_TRIES = 5


def start_redis(cluster: RayCluster) -> subprocess.Popen:
    """A private redis-server on the head host: TLS only, password from its conf, no
    persistence."""
    argv = [shutil.which("redis-server") or "redis-server", str(cluster.redis_conf),
            "--bind", cluster.head.ip, "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(cluster.head.temp_dir)]
    return cluster.net.spawn(cluster.head, argv, cluster.logs / "redis.log", env=cluster.env)


def restart_redis(cluster: RayCluster) -> None:
    """Kill Redis (SIGKILL: a crash, and no persistence, so it comes back empty); start it."""
    if cluster.redis is not None and cluster.redis.poll() is None:
        os.killpg(cluster.redis.pid, signal.SIGKILL)
        cluster.redis.wait(timeout=10)
    # The killed server's listening socket closes once the host's init has reaped it, which
    # can be after nsenter's exit: a server started before then exits at once ("Address
    # already in use"). One that is still running after a moment has its port.
    for _ in range(REDIS_START_TRIES):
        cluster.redis = start_redis(cluster)
        try:
            cluster.redis.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return
        time.sleep(0.5)
    raise RuntimeError(f"redis-server exited at start {REDIS_START_TRIES} times: see "
                       f"{cluster.logs / 'redis.log'}")


def redis_ping(cluster: RayCluster) -> bool:
    """Whether the private Redis answers (asked from the head host)."""
    proc = in_host(cluster, cluster.head, "redis-cli", "--tls", "--cacert",
                   str(cluster.secrets_dir / "ca.pem"), "-h", cluster.head.ip, "-p",
                   str(REDIS_PORT), "ping", timeout=10,
                   env={**cluster.env, "REDISCLI_AUTH": cluster.redis_password})
    return proc.stdout.strip() == "PONG"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):  # noqa: ANN001
    """Poll `predicate` until it returns a truthy value; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def in_host(cluster: RayCluster, host: Host, *cmd: str, timeout: float = 120.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command to completion inside a host with the cluster's environment."""
    return subprocess.run(host.argv(*cmd), capture_output=True, text=True, timeout=timeout,
                          env=env or cluster.env)


def alive_nodes(cluster: RayCluster) -> list[str]:
    """Node IPs the GCS reports alive, asked from the head host (`ray list nodes`)."""
    try:
        proc = in_host(cluster, cluster.head, "python3", "-c",
                       "import ray, json; ray.init(address='auto', logging_level='ERROR');"
                       "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() "
                       "if n['Alive']]))", timeout=60)
    except subprocess.TimeoutExpired:  # a busy box: the caller's wait_for asks again
        return []
    if proc.returncode != 0:
        return []
    return json.loads(proc.stdout.strip().splitlines()[-1])


def job_submit(cluster: RayCluster, entrypoint: list[str], timeout: float = 240.0,
               from_host: Host | None = None) -> subprocess.CompletedProcess:
    """`ray job submit --address DASHBOARD -- ENTRYPOINT`, from the root namespace or a host."""
    argv = ["ray", "job", "submit", "--address", cluster.dashboard_url, "--", *entrypoint]
    if from_host is not None:
        return in_host(cluster, from_host, *argv, timeout=timeout)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=cluster.env)


def boot_cluster(net: Network, logs: Path) -> RayCluster:
    """Redis and a Ray head on hosts[0], Ray workers on the rest; returns when all are alive."""
    logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(32)
    cluster = RayCluster(net=net, token=token, redis_password="", logs=logs,
                         env=make_env(token))
    # The head's secrets directory (~/.ray/kvstore on a real head): the hosts share this
    # machine's /root, so the run keeps its own, private to it.
    cluster.env["KVSTORE_SECURITY_SECRETS_DIR"] = str(logs.parent / "secrets")
    prepare_redis(cluster)
    cluster.redis = start_redis(cluster)
    start_node(cluster, cluster.head)
    start_workers(cluster, net.hosts[1:])
    want = {h.ip for h in net.hosts}
    wait_for(lambda: want <= set(alive_nodes(cluster)), 120, f"Ray nodes {sorted(want)} alive",
             interval=2)
    return cluster


#: Tries per worker host. Ray gives a raylet 30 s to register with the GCS
#: (ray/_private/node.py, not configurable); on a loaded 2-core CI box a start can miss it and
#: `ray start` exits, as an operator's would. The operator starts it again; so does this.
WORKER_START_TRIES = 3


def start_workers(cluster: RayCluster, hosts: list[Host], timeout: float = 180.0) -> None:
    """Start Ray on ``hosts`` and wait until the GCS lists each alive. A host whose `ray start`
    exited first is restarted as a fresh host (its PID 1 killed: nothing of the failed try
    lingers), up to WORKER_START_TRIES starts each."""
    procs = {host.name: start_node(cluster, host) for host in hosts}
    tries = dict.fromkeys(procs, 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = set(alive_nodes(cluster))
        waiting = [h for h in hosts if h.ip not in alive]
        if not waiting:
            return
        for host in waiting:
            if procs[host.name].poll() is None:
                continue
            if tries[host.name] >= WORKER_START_TRIES:
                raise RuntimeError(f"`ray start` on {host.name} exited {tries[host.name]} "
                                   f"times; see {cluster.logs / f'ray-{host.name}.log'}")
            host.kill()
            host.boot()
            procs[host.name] = start_node(cluster, host)
            tries[host.name] += 1
        time.sleep(1.0)
    raise TimeoutError(f"Ray nodes on {[h.name for h in hosts]} not alive after {timeout:.0f}s")


# --- kvstore steps: the CLI contract (`kvstore start/status/generate`) and probe.py ---

PROBE = Path(__file__).resolve().parent / "probe.py"
REPO = PROBE.parents[2]
#: Small blocks and chunks keep the tiny model's jobs fast while a prompt spans several chunks.
GENERATE_FLAGS = ["--model", "tiny", "--block-size", "16", "--chunk-tokens", "32",
                  "--max-new-tokens", "4"]


def kvstore_start(cluster: RayCluster, capacity: str = "256MiB",
                  config: Path | None = None) -> subprocess.CompletedProcess:
    """`kvstore start` on the head against the private Redis, as deploy/cluster.yaml does:
    secure by default, rediss:// (the CA from the secrets directory), the password from its
    file."""
    extra = ["--config", str(config)] if config is not None else []
    return in_host(cluster, cluster.head, "kvstore", "start", "--redis", cluster.redis_url,
                   "--redis-password-file", str(cluster.secrets_dir / "redis_password"),
                   "--capacity", capacity, "--address", cluster.gcs_address, *extra,
                   timeout=180)


def kvstore_stop(cluster: RayCluster) -> subprocess.CompletedProcess:
    """`kvstore stop` on the head."""
    return in_host(cluster, cluster.head, "kvstore", "stop", "--address", cluster.gcs_address,
                   timeout=120)


def kvstore_status(cluster: RayCluster) -> dict:
    """`kvstore status --json` parsed."""
    proc = in_host(cluster, cluster.head, "kvstore", "status", "--json",
                   env={**cluster.env, "RAY_ADDRESS": cluster.gcs_address})
    if proc.returncode != 0:
        raise RuntimeError(f"kvstore status failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _probe_env(cluster: RayCluster) -> dict[str, str]:
    return {**cluster.env, "RAY_ADDRESS": cluster.gcs_address, "PYTHONPATH": str(REPO)}


@dataclass(slots=True)
class Prober:
    """``probe.py serve`` inside the head host: one Ray driver answering every probe call."""

    proc: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, cluster: RayCluster, timeout: float = 120.0) -> Prober:
        """Start it and wait until its driver is connected."""
        proc = subprocess.Popen(cluster.head.argv("python3", str(PROBE), "serve"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(cluster.logs / "probe.log", "ab"),  # noqa: SIM115
                                text=True, env=_probe_env(cluster), start_new_session=True)
        prober = cls(proc)
        threading.Thread(target=prober._read, daemon=True, name="probe-reader").start()
        prober._answer(timeout)
        return prober

    def call(self, args: tuple[str, ...], timeout: float) -> dict:
        """One command; its result, or RuntimeError with the probe's error."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(list(args)) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the driver exited

    def _answer(self, timeout: float):  # noqa: ANN202 - a json value
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()  # a wedged or dead driver: the next call starts a one-shot one
                raise RuntimeError(f"probe driver gave no answer within {timeout:.0f}s "
                                   "(see logs/probe.log)")
            if line.startswith("PROBE="):
                return json.loads(line[len("PROBE="):])
            if line.startswith("PROBE_ERROR="):
                raise RuntimeError(f"probe failed: {json.loads(line[len('PROBE_ERROR='):])}")

    def stop(self) -> None:
        """End the driver (only this process group, which the harness started)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def probe(cluster: RayCluster, *args: str, timeout: float = 150.0) -> dict:
    """Run a tests/multihost/probe.py command in the head host (the session driver when there
    is a live one, else a one-shot driver); its result."""
    if cluster.prober is not None and cluster.prober.proc.poll() is None:
        return cluster.prober.call(args, timeout)
    proc = in_host(cluster, cluster.head, "python3", str(PROBE), *args, timeout=timeout,
                   env=_probe_env(cluster))
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE="):
            return json.loads(line[len("PROBE="):])
    raise RuntimeError(f"probe {args} failed ({proc.returncode}): {proc.stderr[-3000:]}")


def node_of_ip(snapshot: dict, ip: str) -> str:
    """The store node id on the host with address ``ip`` in a probe snapshot."""
    ids = [node_id for node_id, node in snapshot.items() if node["ip"] == ip]
    if len(ids) != 1:
        raise AssertionError(f"expected one store node on {ip}, found {ids} in {snapshot}")
    return ids[0]


def generate_argv(prompts: Path, output: Path, *, no_cache: bool = False,
                  prefill_resource: str | None = "prefill",
                  decode_resource: str | None = "decode", config: Path | None = None,
                  prefill: int = 1, decode: int = 1, salt: str | None = None) -> list[str]:
    """The `kvstore generate` entrypoint: prefill replicas on h1, decode replicas on h2
    (``salt``: the tenant's cache salt)."""
    entry = ["kvstore", "generate", "--prompts", str(prompts), "--prefill-replicas",
             str(prefill), "--decode-replicas", str(decode), *GENERATE_FLAGS,
             "--output", str(output)]
    if prefill_resource:
        entry += ["--prefill-resource", prefill_resource]
    if decode_resource:
        entry += ["--decode-resource", decode_resource]
    if config is not None:
        entry += ["--config", str(config)]
    if no_cache:
        entry.append("--no-cache")
    if salt is not None:
        entry += ["--salt", salt]
    return entry


def read_rows(output: Path) -> list[dict]:
    """A generate output JSONL, sorted by request id."""
    rows = [json.loads(line) for line in output.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: str(r["id"]))


def kvstore_generate(cluster: RayCluster, prompts: Path, output: Path, *,
                     from_host: Host | None = None, timeout: float = 240.0,
                     **kwargs) -> list[dict]:  # noqa: ANN003 - generate_argv's options
    """`ray job submit -- kvstore generate ...`; returns the output JSONL objects by id order."""
    output.unlink(missing_ok=True)
    proc = job_submit(cluster, generate_argv(prompts, output, **kwargs), from_host=from_host,
                      timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"kvstore generate job failed: {proc.stdout[-3000:]}"
                           f"{proc.stderr[-2000:]}")
    return read_rows(output)
