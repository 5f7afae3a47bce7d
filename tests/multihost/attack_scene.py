"""The scene of tests/multihost/test_attacks.py: the secure cluster with tenant A's blocks on
it, the attacker host outside Ray with its credentials, the outcomes log, and the checks every
row shares (A's blocks intact, token ids leaking, resource growth). The test module's fixtures wrap
``scene_on`` and ``write_outcomes``."""

from __future__ import annotations

import contextlib
import json
import secrets
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.cluster.operations import salt_label
from kvstore.config import ServerConfig
from kvstore.keys import SCHEMA_VERSION
from kvstore.security.grants import issue_credential
from kvstore.security.secrets_store import ClusterSecrets, SecretsStore
from tests.multihost import attacker as wire
from tests.multihost.attack_host import (
    Usage,
    add_attacker_host,
    listener_pid,
    remove_host,
)
from tests.multihost.conftest import make_prompts
from tests.multihost.harness import (
    RayCluster,
    in_host,
    kvstore_generate,
    kvstore_status,
    probe,
)
from tests.multihost.netns import Host

TENANT_A, TENANT_B = "tenant-a", "tenant-b"
DEFAULTS = ServerConfig()  # the node's bounds: the cluster runs with the defaults
MiB = 1 << 20
#: Refusal statuses of the gRPC service (kvstore/node/grpc_status.py's table).
DENIED = "PERMISSION_DENIED"
UNAUTHENTICATED = "UNAUTHENTICATED"
#: The bulk channel's status bytes (kvstore/node/bulk_frames.py).
BULK_OK, BULK_UNAUTHENTICATED, BULK_FORBIDDEN = 0, 1, 5
ADMIN_RPCS = ("ListKeys", "Delete", "Evict", "Stats", "ReportReads")
#: What the product answered, row by row, written at the end for the notes (as
#: conftest.RECOVERY_FILE): the attack table's outcome column.
OUTCOMES_FILE = Path(tempfile.gettempdir()) / "kvstore-attack-outcomes.json"
OUTCOMES: dict[str, object] = {}


def write_outcomes() -> None:
    """The outcomes noted so far, to OUTCOMES_FILE (the test module does it at its end)."""
    if OUTCOMES:
        OUTCOMES_FILE.write_text(json.dumps(OUTCOMES, indent=1, sort_keys=True, default=str))


def note(row: str, **what: object) -> None:
    """Record what the product answered for ``row`` (raw bytes left out)."""
    def brief(v: object) -> object:
        if isinstance(v, dict):
            return {k: brief(x) for k, x in v.items() if k != "raw_hex"}
        return v
    OUTCOMES[row] = brief(what)


@dataclass(slots=True)
class Node:
    """A store node as seen from the network: its host, gRPC and bulk addresses, its PID."""

    host: Host
    grpc: str
    bulk: str
    pid: int


@dataclass(slots=True)
class Scene:
    """The cluster under attack, tenant A's blocks on it, and the attacker's credentials."""

    cluster: RayCluster
    attacker: Host
    secrets: ClusterSecrets
    ca: str
    nodes: list[Node]
    holder: Node  # the node holding tenant A's blocks
    a_ns: dict  # tenant A's namespace spec (as the wire carries it)
    a_keys: list[str]
    a_tokens: list[int]  # tenant A's system prompt: the token ids in its blocks' headers
    creds: dict[str, str | None] = field(default_factory=dict)
    tenant_key: str = ""  # tenant A's key (hex), handed to A's writer with its credential

    @property
    def admin(self) -> str:
        return self.secrets.token

    def ns(self, salt: str) -> dict:
        return {**self.a_ns, "cache_salt": salt}


def _kvstore_ls(cluster: RayCluster) -> dict:
    proc = in_host(cluster, cluster.head, "kvstore", "ls", "--json", "--limit", "1000",
                   env={**cluster.env, "RAY_ADDRESS": cluster.gcs_address})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _issue(cluster: RayCluster, subject: str, tenant: str) -> dict:
    """A tenant's write credential and tenant key, as the operator hands them out
    (``kvstore credentials issue --tenant-key`` on the head)."""
    proc = in_host(cluster, cluster.head, "kvstore", "credentials", "issue", "--subject",
                   subject, "--write", tenant, "--ttl", "1h", "--tenant-key")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _new_keys(before: dict, after: dict) -> dict[str, set[str]]:
    return {nid: set(n["held"]) - set(before.get(nid, {}).get("held", []))
            for nid, n in after.items()}


@contextlib.contextmanager
def scene_on(kvstore_cluster: RayCluster, work_dir: Path, prompt_files: dict[str, Path],
             reference: dict[str, list[int]], job_config: Path) -> Iterator[Scene]:
    """Tenant A's prompts run as a job (its blocks land on h1), the secrets `kvstore start`
    made, the nodes' addresses, and the attacker host with its credentials."""
    cluster = kvstore_cluster
    store = SecretsStore(cluster.env["KVSTORE_SECURITY_SECRETS_DIR"])
    assert store.exists(), "kvstore start made no cluster secrets: it runs without auth"
    sec = store.load()
    before = probe(cluster, "snapshot")
    rows = kvstore_generate(cluster, prompt_files["tenant"], work_dir / "tenant-a.jsonl",
                            config=job_config, salt=TENANT_A)
    assert [r["output_token_ids"] for r in rows] == [reference[r["id"]] for r in rows]
    new = _new_keys(before, probe(cluster, "snapshot"))
    holder_id = max(new, key=lambda nid: len(new[nid]))
    assert len(new[holder_id]) >= 6, f"tenant A's job stored no blocks: {new}"
    described = [n for n in _kvstore_ls(cluster)["namespaces"]
                 if n.get("described") and n.get("salt") == salt_label(TENANT_A)]
    assert described, "no worker described tenant A's namespace"
    d = described[0]
    a_ns = {"schema_version": SCHEMA_VERSION, "model_fingerprint": d["model_fingerprint"],
            "dtype": d["dtype"], "block_size": d["block_size"], "num_layers": d["num_layers"],
            "num_kv_heads": d["num_kv_heads"], "head_dim": d["head_dim"],
            "cache_salt": TENANT_A, "numerics": d.get("numerics", "")}
    status = kvstore_status(cluster)
    ca = sec.ca.cert_pem
    hosts = {h.ip: h for h in cluster.net.hosts}
    nodes, holder = [], None
    for n in status["nodes"]:
        if not n.get("alive", True):
            continue
        h = wire.health(n["address"], ca, sec.token)
        assert h["code"] == "OK", h
        bulk = h["bulk_address"]
        host = hosts[n["address"].rpartition(":")[0]]
        node = Node(host, n["address"], bulk, listener_pid(host, int(bulk.rpartition(":")[2])))
        nodes.append(node)
        if n["node_id"] == holder_id:
            holder = node
    assert holder is not None, f"the node {holder_id} holding tenant A's blocks is not listed"
    a_tokens = make_prompts()["tenant"][0]["token_ids"][:96]
    attacker = add_attacker_host(cluster.net, work_dir / "hosts")
    s = Scene(cluster, attacker, sec, ca, nodes, holder, a_ns, sorted(new[holder_id]), a_tokens)
    a_issued, b_issued = (_issue(cluster, subject, tenant) for subject, tenant in
                          (("tenant-a-writer", TENANT_A), ("tenant-b-writer", TENANT_B)))
    s.tenant_key = a_issued["tenant_keys"][TENANT_A]
    s.creds = {
        "none": None,
        "wrong": secrets.token_urlsafe(32),
        "forged": issue_credential(secrets.token_urlsafe(32), "mallory", admin=True),
        "a": a_issued["credential"],
        "b": b_issued["credential"],
    }
    try:
        yield s
    finally:
        remove_host(attacker)


# --- helpers ----------------------------------------------------------------------------------

def leaks(raw_hex: str, token_ids: list[int], block_size: int = 16) -> bool:
    """Whether any full block's token ids (int64 LE, as block headers carry them) are in the
    bytes: what a reader would decode another tenant's prompt from."""
    raw = bytes.fromhex(raw_hex)
    return any(struct.pack(f"<{block_size}q", *token_ids[i:i + block_size]) in raw
               for i in range(0, len(token_ids) - block_size + 1, block_size))


def assert_a_intact(s: Scene) -> None:
    """Every block of tenant A is still held by its node and readable by the cluster token."""
    got = wire.exists(s.holder.grpc, s.ca, s.admin, s.a_keys, s.a_ns)
    assert got["code"] == "OK" and all(got["present"]), got


def admin_bulk(s: Scene) -> dict:
    """The control: the cluster token's bulk read of tenant A's blocks, from outside."""
    return wire.bulk_read(s.holder.bulk, s.ca, s.admin, s.a_keys, s.a_ns, expect_bytes=16 * MiB)


def grow(before: Usage, after: Usage) -> tuple[int, int]:
    return after.rss_bytes - before.rss_bytes, after.threads - before.threads


def wait_until(measure, ok, timeout: float):  # noqa: ANN001, ANN202 - any measurement
    """Measure every 0.5 s until ``ok(value)`` or ``timeout``; the last value."""
    deadline = time.monotonic() + timeout
    value = measure()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = measure()
    return value
