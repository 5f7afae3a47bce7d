"""What security costs on the data path: the product read path, plain vs a secure store node.

A cluster started the documented way (docs/security.md) runs its store nodes with the cluster
token (``server.auth_token``), TLS from a certificate issued by the cluster's private CA
(``kvstore.security.ca``) on gRPC and the bulk channel, and the cluster's data key, so every
namespace is keyed and each block carries an AES-GMAC tag instead of an xxh3 checksum
(``kvstore.security.data_keys``). Its clients present the token and trust the CA
(``client.tls_ca_pem``). This benchmark starts three nodes in other processes, each holding the
same blocks, and reads them through ``ClusterStore`` (lease, fetch, verify) in turns:

- ``plain``: no token, no TLS, no data key (the embedded loopback default);
- ``keyed``: token and data key, no TLS: the MAC's cost (and the token's, one check a call);
- ``secure``: token, TLS and data key: everything a cluster has on by default.

``secure / plain`` is what a deployment pays; ``keyed / plain`` and ``secure / keyed`` tell
the MAC's share from TLS's. Remote reads move the blocks over the bulk channel (TLS there means
no sendfile and no scatter read: the bytes pass through OpenSSL on both sides); same-node reads
copy out of the node's shared memory, so TLS only wraps the lease call and the MAC is the cost.

    python -m benchmarks.bench_transfer_secure [--quick] [--json bench-results/secure.json]

``python -m benchmarks.bench_transfer`` runs this arm too (``--no-secure`` skips it).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import parse_args, report
from benchmarks.transfer_support import (
    block_tokens,
    cluster_store,
    gbps,
    make_blocks,
    race,
    store_fetch,
)
from kvstore.api import NodeAddress
from kvstore.client.block_buffers import new_block_buffer
from kvstore.client.cluster_store import ClusterStore
from kvstore.client.node_client import StoreNodeClient
from kvstore.config import ClientConfig
from kvstore.keys import Namespace
from kvstore.security.ca import issue_server_cert, new_ca

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("plain", "keyed", "secure")

# The node's secrets come on stdin (one JSON line), never in argv, as kvstore start hands them.
SERVER = """
import json, sys
from kvstore.config import ServerConfig
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
spec = json.loads(sys.stdin.readline())
pool = BlockPool(spec["capacity"])
cfg = ServerConfig(max_workers=4, auth_token=spec["token"], tls_cert_pem=spec["cert"],
                   tls_key_pem=spec["key"])
key = bytes.fromhex(spec["data_key"]) if spec["data_key"] else None
srv = StoreServer(pool, spec["node_id"], cfg, data_key=key)
g, b = srv.start()
print(g, b, pool.path, flush=True)
sys.stdin.read()
srv.stop(0)
pool.close()
"""


@dataclass
class Arm:
    """One node configuration, its client settings, and the same blocks in its namespaces."""

    name: str
    token: str | None
    cert_key: tuple[str, str] | None  # the node's certificate and key (PEM), TLS on
    ca_pem: str | None
    data_key: bytes | None
    big_ns: Namespace = field(init=False)
    small_ns: Namespace = field(init=False)

    def __post_init__(self) -> None:
        self.big_ns = Namespace("bench", "float16", 16, 32, 8, 128, data_key=self.data_key)
        self.small_ns = Namespace("bench", "float16", 16, 1, 8, 128, data_key=self.data_key)

    def client_config(self) -> ClientConfig:
        return ClientConfig(timeout_s=120, auth_token=self.token, tls_ca_pem=self.ca_pem)


def make_arms() -> list[Arm]:
    """A cluster's secrets made here as ``kvstore start`` makes them: a token, a private CA
    with a certificate for 127.0.0.1, a 32-byte data key."""
    token, data_key = secrets.token_urlsafe(32), secrets.token_bytes(32)
    ca = new_ca()
    cert_key = issue_server_cert(ca, ["127.0.0.1"])
    return [Arm("plain", None, None, None, None),
            Arm("keyed", token, None, None, data_key),
            Arm("secure", token, cert_key, ca.cert_pem, data_key)]


class NodeProcess:
    """A store node in another process, started with ``arm``'s settings."""

    def __init__(self, arm: Arm, capacity: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout is not None and self.proc.stdin is not None
        cert, key = arm.cert_key or (None, None)
        self.proc.stdin.write(json.dumps({
            "capacity": capacity, "node_id": arm.name, "token": arm.token, "cert": cert,
            "key": key, "data_key": arm.data_key.hex() if arm.data_key else None}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if len(line) != 3:
            self.close()
            raise RuntimeError(f"the {arm.name} bench node did not start")
        grpc_port, bulk_port, shm_path = line
        self.address = NodeAddress(arm.name, f"127.0.0.1:{grpc_port}",
                                   f"127.0.0.1:{bulk_port}", shm_path)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Loaded:
    """One arm's node holding its blocks, and the readers and buffers the races use."""

    arm: Arm
    node: NodeProcess
    big: tuple[list[bytes], list[bytearray]]
    small: tuple[list[bytes], list[bytearray]]
    stores: list[ClusterStore] = field(default_factory=list)

    def store(self, ns: Namespace, keys: list[bytes], reader: str) -> ClusterStore:
        s = cluster_store(self.node.address, ns, keys, reader, self.arm.client_config())
        self.stores.append(s)
        return s

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.node.close()


def load(arm: Arm, n_big: int, n_small: int) -> Loaded:
    big, small = make_blocks(arm.big_ns, n_big), make_blocks(arm.small_ns, n_small)
    capacity = sum(map(len, big[1])) + sum(map(len, small[1])) + (64 << 20)
    node = NodeProcess(arm, capacity)
    try:
        a = node.address
        with StoreNodeClient(a.grpc_address, bulk_address=a.bulk_address,
                             config=arm.client_config()) as client:
            for i in range(0, n_big, 16):
                client.put_blocks(arm.big_ns, list(zip(big[0][i:i + 16], big[1][i:i + 16],
                                                       strict=True)))
            client.put_blocks(arm.small_ns, list(zip(*small, strict=True)))
    except BaseException:
        node.close()
        raise
    return Loaded(arm, node, big, small)


def measure(loaded: list[Loaded], what: str, n: int, repeats: int) -> dict[str, float]:
    """Race one product-path read across the arms; returns each arm's GB/s (keys: arm names)
    after checking the last block each read equals what was put."""
    fns: dict[str, Callable[[], object]] = {}
    checks: list[tuple[torch.Tensor, int, bytearray]] = []
    nbytes: dict[str, int] = {}
    for ld in loaded:
        remote = what.startswith("remote")
        ns = ld.arm.small_ns if what == "remote_64kib" else ld.arm.big_ns
        keys, blocks = ld.small if what == "remote_64kib" else ld.big
        batch = {"remote_64kib": 128, "remote_2mib": 32, "samenode_2mib": 128}[what]
        store = ld.store(ns, keys, "another-node" if remote else ld.arm.name)
        out = new_block_buffer(ns, min(batch, n))
        fns[ld.arm.name] = partial(store_fetch, store, ns, keys, block_tokens(ns, n), batch, out)
        checks.append((out, (n - 1) % batch, blocks[n - 1]))
        nbytes[ld.arm.name] = sum(map(len, blocks))
    best = race(fns, repeats)
    for out, row, expected in checks:
        if bytes(out[row].numpy()) != expected:
            raise RuntimeError(f"bench {what}: a block read back differs from what was put")
    return {name: gbps(nbytes[name], t) for name, t in best.items()}


LABELS = {
    "remote_64kib": ("remote ClusterStore 64 KiB x128 + verify", "remote 64 KiB"),
    "remote_2mib": ("remote ClusterStore 2 MiB x32 + verify", "remote 2 MiB"),
    "samenode_2mib": ("same-node batch_get_into 2 MiB x128", "same-node 2 MiB"),
}
GBPS_KEYS = {"remote_64kib": "remote_verified_gbps_64kib_batch128",
             "remote_2mib": "remote_verified_gbps_2mib_batch32",
             "samenode_2mib": "samenode_gbps_2mib"}


def bench_secure(quick: bool) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
    """The figures (flat, ``<arm>_<measure>`` GB/s and ``ratio_<arm>_vs_plain_<measure>``)
    and the table rows of the three arms, at bench_transfer's sizes."""
    n_big, n_small = (64, 256) if quick else (256, 1024)
    repeats = 3 if quick else 7
    loaded: list[Loaded] = []
    try:
        for arm in make_arms():
            loaded.append(load(arm, n_big, n_small))
        got = {what: measure(loaded, what, n_small if what == "remote_64kib" else n_big,
                             repeats) for what in LABELS}
    finally:
        for ld in loaded:
            ld.close()
    figures: dict[str, float] = {}
    rows: list[tuple[str, str, str]] = []
    for what, by_arm in got.items():
        for name, v in by_arm.items():
            figures[f"{name}_{GBPS_KEYS[what]}"] = v
        figures[f"ratio_secure_vs_plain_{what}"] = by_arm["secure"] / by_arm["plain"]
        figures[f"ratio_keyed_vs_plain_{what}"] = by_arm["keyed"] / by_arm["plain"]
        figures[f"ratio_secure_vs_keyed_{what}"] = by_arm["secure"] / by_arm["keyed"]
        long, short = LABELS[what]
        rows.append((f"secure node: {long} (GB/s)", f"{by_arm['secure']:.2f}",
                     f"plain {by_arm['plain']:.2f} / MAC, no TLS {by_arm['keyed']:.2f}"))
        rows.append((f"ratio secure vs plain {short}",
                     f"{figures[f'ratio_secure_vs_plain_{what}']:.2f}x",
                     f"MAC, no TLS {figures[f'ratio_keyed_vs_plain_{what}']:.2f}x, TLS on top "
                     f"{figures[f'ratio_secure_vs_keyed_{what}']:.2f}x"))
    figures["secure_num_blocks_2mib"] = n_big
    figures["secure_num_blocks_64kib"] = n_small
    return figures, rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    figures, rows = bench_secure(args.quick)
    report("kvstore block transfer: plain vs secure node", rows, figures, args.json)


if __name__ == "__main__":
    main()
