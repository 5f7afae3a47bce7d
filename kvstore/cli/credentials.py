"""``kvstore credentials ...`` and ``kvstore rotate-credentials``: the cluster's secrets by hand.

Secrets are printed only where the command exists to print one (``issue`` prints the credential
it made, ``--tenant-key`` the tenant key asked for) and go to stdout alone, never to a log or
stderr; everything else names files and says on/off. A credential to inspect is read from
stdin (``show -``) so it need not sit in argv, where ``ps`` shows it. docs/security.md explains
tenants, credentials and rotation; docs/cli.md lists the flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from typing import Any

from kvstore.cli.cache import connect, operator_config
from kvstore.command_flags import RUNNING_CLUSTER, add_config_flags
from kvstore.errors import ConfigError

_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_TTL_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_ttl(text: str | None) -> float | None:
    """``30d`` -> seconds; ``none``/``never`` -> None (no expiry)."""
    if text is None or text.lower() in ("none", "never", "0"):
        return None
    m = _TTL.match(text)
    if not m:
        raise ConfigError(f"--ttl {text!r} is not a duration: a number with s, m, h, d or w "
                          "(e.g. 12h, 30d), or 'never'")
    return float(m.group(1)) * _TTL_UNITS[m.group(2)]


def _store(args: argparse.Namespace) -> Any:
    from kvstore.security.secrets_store import SecretsStore

    config = operator_config(args)
    if getattr(args, "secrets_dir", None):
        return SecretsStore(args.secrets_dir)
    return SecretsStore.for_config(config.security)


def _cluster_token(args: argparse.Namespace) -> str:
    """The cluster token: the secrets directory's, else ``server.auth_token``, else the
    running cluster's (over Ray)."""
    store = _store(args)
    if store.exists():
        return str(store.load().token)
    config = operator_config(args)
    if config.server.auth_token:
        return config.server.auth_token
    if args.address or _ray_named():
        from kvstore.cluster.lifecycle import running_config

        connect(args)
        running = running_config()
        if running is not None and running.server.auth_token:
            return running.server.auth_token
    raise ConfigError(f"no cluster token: no secrets in {store.path} (--secrets-dir), no "
                      "server.auth_token, and no secure kvstore running on the named cluster")


def _ray_named() -> bool:
    from kvstore.cluster.address import resolve

    return resolve(None).address is not None


def cmd_init(args: argparse.Namespace) -> int:
    """Make the cluster's secrets now (or check the existing ones); prints no secret."""
    store = _store(args)
    secrets_, created = store.load_or_create()
    if args.redis_password:
        store.with_redis_password()
    print(f"{'made' if created else 'found'} cluster secrets in {store.path} "
          f"(CA: {secrets_.ca!r})")
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    """Print a tenant credential signed under the cluster token (stdout, nothing else)."""
    from kvstore.security.grants import issue_credential

    ttl = parse_ttl(args.ttl)
    cred = issue_credential(_cluster_token(args), args.subject, read=args.read or (),
                            write=args.write or (), admin=args.admin, ttl_s=ttl)
    if not args.tenant_key:
        print(cred)
        return 0
    out: dict[str, Any] = {"credential": cred, "tenant_keys": {}}
    store = _store(args)
    data_key = store.load().data_key if store.exists() else operator_config(
        args).security.data_key
    if not data_key:
        raise ConfigError("--tenant-key needs the data key (the secrets directory's data_key "
                          "or security.data_key)")
    from kvstore.security.data_keys import tenant_key

    for tenant in sorted(set(args.write or ()) | set(args.read or ())):
        if tenant == "*":
            raise ConfigError("--tenant-key is per tenant: name tenants, not '*'")
        out["tenant_keys"][tenant] = tenant_key(bytes.fromhex(data_key), tenant).hex()
    print(json.dumps(out, indent=2))
    return 0


def describe_credential(cred: str, cluster_token: str | None) -> dict[str, Any]:
    """What a credential grants, and whether it verifies under ``cluster_token`` (if known)."""
    from kvstore.security.grants import Authenticator, inspect_credential

    grant = inspect_credential(cred)
    verified: bool | None = None
    if cluster_token:
        try:
            Authenticator([cluster_token]).authenticate(cred)
            verified = True
        except Exception:  # noqa: BLE001 - Unauthenticated: a wrong signature or expired
            verified = False
    expires = (datetime.datetime.fromtimestamp(grant.expires_at, datetime.timezone.utc)
               .isoformat(timespec="seconds") if grant.expires_at else "never")
    return {"subject": grant.subject, "read": sorted(grant.read), "write": sorted(grant.write),
            "admin": grant.admin, "expires": expires, "valid_here": verified}


def cmd_show(args: argparse.Namespace) -> int:
    """What a credential grants; ``-`` reads it from stdin (keeps it out of argv)."""
    cred = sys.stdin.readline().strip() if args.credential == "-" else args.credential
    store = _store(args)
    token = store.load().token if store.exists() else None
    info = describe_credential(cred, token)
    if args.json:
        print(json.dumps(info))
        return 0
    valid = {True: "yes (signed under this cluster's token, not expired)",
             False: "NO (another or a rotated cluster token, or expired)",
             None: "unknown (no cluster secrets here)"}[info["valid_here"]]
    print(f"subject: {info['subject']}\nread:    {', '.join(info['read']) or '-'}\n"
          f"write:   {', '.join(info['write']) or '-'}\nadmin:   {info['admin']}\n"
          f"expires: {info['expires']}\nvalid:   {valid}")
    return 0


def cmd_redis_conf(args: argparse.Namespace) -> int:
    """Write a redis.conf include (0600) with a generated password and, with --tls-host, a
    certificate from the cluster CA; the password stays in the secrets directory for kvstore."""
    from pathlib import Path

    from kvstore.security.ca import issue_server_cert
    from kvstore.security.secrets_store import REDIS_PASSWORD_FILE, write_private

    store = _store(args)
    store.load_or_create()
    secrets_ = store.with_redis_password()
    lines = [f"requirepass {secrets_.redis_password}"]
    if args.tls_host:
        cert, key = issue_server_cert(secrets_.ca, args.tls_host, name="kvstore redis")
        write_private(store.path / "redis.crt", cert)
        write_private(store.path / "redis.key", key)
        lines += [f"port {args.plain_port}", f"tls-port {args.port}",
                  f"tls-cert-file {store.path / 'redis.crt'}",
                  f"tls-key-file {store.path / 'redis.key'}",
                  f"tls-ca-cert-file {store.path / 'ca.pem'}", "tls-auth-clients no"]
    out = Path(args.out)
    write_private(out, "\n".join(lines) + "\n")
    print(f"wrote {out} (password in {store.path / REDIS_PASSWORD_FILE}"
          + (f"; TLS on port {args.port}: rediss://HOST:{args.port}/0 with "
             f"index.redis_ca_file={store.path / 'ca.pem'}" if args.tls_host else "") + ")")
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    """A new cluster token pushed to the running cluster; ``--finish`` drops the old one."""
    from kvstore.cluster import lifecycle, rotation

    operator_config(args)
    connect(args)
    running = rotation.check_running(lifecycle.running_config())
    store = _store(args) if args.secrets_dir else None
    report = rotation.rotate(running, finish=args.finish, store=store)
    live, restart = len(report.nodes_live), len(report.nodes_restart)
    if report.step == "rotate":
        print(f"new cluster token saved in {report.secrets_dir}; {live} store node(s) accept "
              "the new and the old token" + (f", {restart} keep the old until restarted"
                                              if restart else "")
              + "; new node certificates take effect when a node restarts. Re-issue tenant "
              "credentials, then run `kvstore rotate-credentials --finish`.")
    else:
        print(f"rotation finished: the previous token is refused on {live} store node(s)"
              + (f" ({restart} still accept it until restarted)" if restart else ""))
    if not report.coordinator_live:
        print("kvstore: note: the coordinator's index service keeps its old tokens until it "
              "restarts; store nodes use the coordinator actor meanwhile", file=sys.stderr)
    return 0


def _secrets_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secrets-dir", metavar="DIR",
                   help="the cluster's secrets directory (default: security.secrets_dir, "
                        "else ~/.ray/kvstore)")


def register(sub: Any) -> None:
    """Add ``credentials`` (init, issue, show, redis-conf) and ``rotate-credentials``."""
    p = sub.add_parser("credentials", help="cluster secrets and tenant credentials")
    csub = p.add_subparsers(dest="credentials_command", required=True, metavar="ACTION",
                            help="init, issue, show or redis-conf")

    q = csub.add_parser("init", help="make the cluster's secrets now (prints no secret)")
    add_config_flags(q, address_fallback=RUNNING_CLUSTER)
    _secrets_dir_flag(q)
    q.add_argument("--redis-password", action="store_true",
                   help="also make a Redis password (redis_password in the directory)")
    q.set_defaults(func=cmd_init)

    q = csub.add_parser("issue", help="print a tenant credential (client.auth_token)")
    add_config_flags(q, address_fallback=RUNNING_CLUSTER)
    _secrets_dir_flag(q)
    q.add_argument("--subject", required=True, metavar="NAME",
                   help="who it is for (shown in refusals and audit)")
    q.add_argument("--read", nargs="+", metavar="TENANT",
                   help="tenants (cache salts; '' the default one, '*' all) it may read")
    q.add_argument("--write", nargs="+", metavar="TENANT",
                   help="tenants it may write (and so read)")
    q.add_argument("--admin", action="store_true",
                   help="admin calls too (ListKeys, Delete, Evict, Stats)")
    q.add_argument("--ttl", default="30d", metavar="DURATION",
                   help="lifetime, e.g. 12h, 30d, or 'never' (default 30d)")
    q.add_argument("--tenant-key", action="store_true",
                   help="print JSON with the tenant key(s) as well, for clients that compute "
                        "keys and block MACs themselves")
    q.set_defaults(func=cmd_issue)

    q = csub.add_parser("show", help="what a credential grants ('-': read it from stdin)")
    add_config_flags(q, address_fallback=RUNNING_CLUSTER)
    _secrets_dir_flag(q)
    q.add_argument("credential", metavar="CREDENTIAL",
                   help="the credential, or '-' to read it from stdin (kept out of ps)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=cmd_show)

    q = csub.add_parser("redis-conf", help="write a redis.conf include with a generated "
                                           "password (and TLS from the cluster CA)")
    add_config_flags(q, address_fallback=RUNNING_CLUSTER)
    _secrets_dir_flag(q)
    q.add_argument("--out", required=True, metavar="FILE", help="the include to write (0600)")
    q.add_argument("--tls-host", nargs="+", metavar="HOST",
                   help="Redis's IPs/host names: issue it a certificate and turn TLS on")
    q.add_argument("--port", type=int, default=6380, help="the TLS port (with --tls-host)")
    q.add_argument("--plain-port", type=int, default=0,
                   help="the plaintext port with --tls-host (default 0: off)")
    q.set_defaults(func=cmd_redis_conf)

    p = sub.add_parser("rotate-credentials",
                       help="new cluster token and node certificates, no restart, no block lost")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    _secrets_dir_flag(p)
    p.add_argument("--finish", action="store_true",
                   help="stop accepting the previous token (after clients moved on)")
    p.set_defaults(func=cmd_rotate)
