"""The disk tier (``kvstore.node.tiered_pool``), measured against baselines in the same run.

* Trace replay: the synthetic trace through a ``TieredPool`` whose arena holds 10% of the working
  set and whose disk tier holds 100% of it (the arena's LRU demoted, every hit read back through
  a lease and verified), against an exact LRU of the combined capacity (``trace_sim``) and the
  arena alone: ``ratio_hit_vs_lru_tiered``, ``hit_rate_arena_only``, ``wrong_blocks``.
* Disk reads: 2 MiB blocks fetched from the disk tier, one lease per 32 blocks (promoted into
  the arena by the pipelined reader, verified by the node, then copied out and verified as a
  same-node client does) against plain sequential ``read()``s of the same bytes from one file in
  the same directory, the page cache dropped before each (needs root; the JSON says whether it
  was). Each read path (``direct``, ``buffered``) and one block a lease are measured, the
  rounds interleaved with the file reads and medians compared; the faster path is
  ``disk_read_path`` and gives ``ratio_disk_read_vs_file_read``.
  ``ratio_disk_promote_vs_file_read`` is the node's part alone (the leases).
* Restart: the tier closed and opened again: ``restart_recovered_ratio``, ``restart_recovery_s``.
* Kills: a writer process SIGKILLed during demotions, repeatedly; every block the reopened tier
  exposes is read and verified: ``torn_blocks_after_kill``.

* Warm TTFT (``benchmarks.tier_ttft``): the ``small`` model over a real store node (gRPC
  leases, same-node shared memory), a shared prompt (``--quick`` 512 tokens, else 2048) whose
  blocks sit only on disk against the same blocks in the arena, outputs checked against
  ``use_cache=False``: ``ratio_warm_ttft_disk_vs_arena`` (lower is better: a target <= 2).

    python -m benchmarks.bench_tier [--quick] [--json PATH] [--dir DIR]
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import parse_args, report
from benchmarks.tier_ttft import bench_warm_ttft
from benchmarks.trace_sim import TraceExpander, load_trace, simulate_lru
from kvstore.block import block_nbytes, encode_block, verify_block
from kvstore.client.file_reads import read_leased
from kvstore.client.shm_reader import ShmReader
from kvstore.errors import PoolFull
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier
from kvstore.node.tiered_pool import TieredPool

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
TRACE_NS = Namespace("bench-tier", "float16", 64, 1, 1, 8)
BIG_NS = Namespace("bench-tier-big", "float16", 16, 32, 8, 128)  # 2 MiB of payload a block


def drop_caches() -> bool:
    """Drop the page cache (root only); False when it could not be."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def payload_for(ns: Namespace, key: bytes) -> torch.Tensor:
    return torch.full(ns.payload_shape, float(key[0] - 128) / 8).to(ns.torch_dtype)


def make_room(pool: TieredPool, nbytes: int) -> None:
    """A full arena's LRU goes to disk (what the coordinator's arena plan orders)."""
    n = max(1, -(-nbytes // block_nbytes(TRACE_NS)) * 8)
    pool.demote(pool.arena.lru_candidates(n))


def replay(pool: TieredPool, requests: list, queue_bytes: int) -> tuple[int, int, int, int]:
    """(lookups, prefix hits, wrong blocks, waits for the disk) of the requests through
    ``pool``.

    The replay runs many times faster than the trace's own clock, so the demotion writer gets
    far less time per request than the trace gives it. Before a request, a demotion queue more
    than half full is drained (counted as a wait): what is measured is the tiers' LRU, not
    whether this disk keeps up with an unpaced replay (``trace_span_s`` / ``replay_s`` say how
    much faster than the trace it ran)."""
    lookups = hits = wrong = waits = 0
    nb = block_nbytes(TRACE_NS)
    for req in requests:
        if pool.queued_bytes > queue_bytes // 2:
            pool.flush(120)
            waits += 1
        keys = req.keys
        lookups += len(keys)
        held = pool.held(keys)
        n = held.index(False) if False in held else len(keys)
        if n:
            lease = pool.lease(keys[:n], 30.0)
            if len(lease.locations) < n:  # no room to promote: make room, ask again
                pool.release(lease.lease_id)
                make_room(pool, n * nb)
                lease = pool.lease(keys[:n], 30.0)
            # A lease lists its locations in no promised order (promoted blocks may come
            # after the arena's): each is checked against its own key's tokens.
            tokens_of = dict(zip(keys, req.token_ids, strict=True))
            try:
                for loc in lease.locations:
                    data = bytes(pool.leased_bytes(loc.offset, loc.nbytes))
                    try:
                        verify_block(data, TRACE_NS, loc.key, tokens_of[loc.key])
                    except Exception:
                        wrong += 1
                hits += len(lease.locations)
            finally:
                pool.release(lease.lease_id)
        rest = zip(keys[n:], req.parent_keys[n:], req.token_ids[n:], strict=True)
        for key, parent, tokens in rest:
            if pool.contains(key):
                continue
            blk = encode_block(TRACE_NS, key, parent, tokens, payload_for(TRACE_NS, key))
            for _ in range(3):
                try:
                    pool.put(key, blk)
                    break
                except PoolFull:
                    make_room(pool, nb)
        pool.touch(keys)
    return lookups, hits, wrong, waits


def bench_trace(quick: bool, workdir: Path) -> dict[str, float]:
    requests_raw = load_trace(TRACE, 200 if quick else None)
    expander = TraceExpander(TRACE_NS)
    requests = [expander.expand(r) for r in requests_raw]
    working_set = len({k for r in requests for k in r.keys})
    arena_blocks = max(8, working_set // 10)
    nb = block_nbytes(TRACE_NS)
    slot = -(-nb // 64) * 64
    disk_bytes = working_set * (-(-nb // 4096) * 4096)
    exact = simulate_lru([r.keys for r in requests], arena_blocks + working_set)
    arena_only = simulate_lru([r.keys for r in requests], arena_blocks)
    queue_bytes = 64 << 20
    pool = TieredPool(BlockPool(arena_blocks * slot), DiskTier(str(workdir / "trace"), disk_bytes),
                      queue_bytes=queue_bytes)
    t0 = time.perf_counter()
    try:
        lookups, hits, wrong, waits = replay(pool, requests, queue_bytes)
        replay_s = time.perf_counter() - t0
        dropped = sum(pool.counters.drops.values())
    finally:
        pool.close(purge=True)
    exact_rate = exact.prefix_hit_rate
    rate = hits / max(1, lookups)
    return {"trace_requests": len(requests), "working_set_blocks": working_set,
            "arena_blocks": arena_blocks, "hit_rate_tiered": rate,
            "hit_rate_exact_lru_combined": exact_rate,
            "hit_rate_arena_only": arena_only.prefix_hit_rate,
            "ratio_hit_vs_lru_tiered": rate / exact_rate if exact_rate else 0.0,
            "wrong_blocks": wrong, "replay_s": replay_s,
            "trace_span_s": (requests_raw[-1].timestamp_ms - requests_raw[0].timestamp_ms) / 1000,
            "demotion_queue_waits": waits, "tier_drops": dropped}


def make_big_blocks(n: int) -> tuple[list[bytes], list[list[int]], list[bytes]]:
    tokens = [random.Random(7).randrange(50_000) for _ in range(n * BIG_NS.block_size)]
    keys = [bytes(k) for k in BlockHasher(BIG_NS).block_keys(tokens)]
    per = [tokens[i * 16:(i + 1) * 16] for i in range(n)]
    parents = [BIG_NS.root, *keys[:-1]]
    blocks = [bytes(encode_block(BIG_NS, k, p, t, payload_for(BIG_NS, k)))
              for k, p, t in zip(keys, parents, per, strict=True)]
    return keys, per, blocks


def fetch_leased(pool: TieredPool, keys: list[bytes], tokens: list[list[int]],
                 outs: list[bytearray], lease_blocks: int, files: bool) -> tuple[float, int]:
    """A same-node reader's fetch of ``keys``, ``lease_blocks`` a lease, as ``StoreNodeClient``
    does it: with ``files``, cold disk blocks come as their files and are read into ``outs``
    and verified by the reader (``file_reads``); without, the lease promotes (the node reads
    and verifies) and the blocks are copied out of the arena and verified. Returns (seconds
    in leases, blocks read)."""
    reader = ShmReader(pool.path)
    lease_s = 0.0
    readable = 0
    try:
        for lo in range(0, len(keys), lease_blocks):
            batch = keys[lo:lo + lease_blocks]
            t0 = time.perf_counter()
            lease = pool.lease(batch, 30.0, files=files)
            lease_s += time.perf_counter() - t0
            where = {loc.key: loc for loc in lease.locations}
            again: list[int] = []
            got = read_leased(reader, where, batch, outs[lo:lo + lease_blocks], BIG_NS,
                              tokens[lo:lo + lease_blocks], lambda: None, again)
            readable += sum(isinstance(g, int) for g in got)
            pool.release(lease.lease_id)
            assert not again, f"{len(again)} files could not be read"
    finally:
        reader.close()
    return lease_s, readable


def bench_reads_and_restart(quick: bool, workdir: Path) -> dict[str, float | str]:
    """Disk-tier fetches by each read path (and one block a lease) against plain reads of one
    file, interleaved over rounds (the device is shared and noisy): medians compared."""
    n = 32 if quick else 128
    rounds = 3 if quick else 5
    lease_blocks = 32  # a 512-token prefix of 2 MiB blocks: one lease, as a reader asks
    keys, tokens, blocks = make_big_blocks(n)
    nb = len(blocks[0])
    directory = workdir / "reads"
    capacity = (n + 2) * nb * 2
    pool = TieredPool(BlockPool((n + 2) * nb), DiskTier(str(directory), capacity),
                      queue_bytes=1 << 30)
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    pool.demote(keys)
    pool.flush(120)
    pool.close()  # kvstore stop: the disk tier stays
    t0 = time.perf_counter()
    disk = DiskTier(str(directory), capacity)
    recovery_s = time.perf_counter() - t0
    recovered = len(disk)
    disk.close()
    plain = workdir / "plain.bin"
    with open(plain, "wb") as f:
        for b in blocks:
            f.write(b)
    outs = [bytearray(nb) for _ in range(n)]
    # "files": the path a same-node reader takes for cold disk blocks; the promotions are
    # what a remote reader's (or a hot block's) read costs.
    variants = {"files": ("direct", lease_blocks, True),
                "files_one_a_lease": ("direct", 1, True),
                "promote_direct": ("direct", lease_blocks, False),
                "promote_buffered": ("buffered", lease_blocks, False)}
    fetch: dict[str, list[float]] = {v: [] for v in variants}
    promote: dict[str, list[float]] = {v: [] for v in variants}
    file_s: list[float] = []
    readable = n
    dropped = True
    for _ in range(rounds):
        dropped = drop_caches() and dropped
        buf = bytearray(nb)
        t0 = time.perf_counter()
        with open(plain, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        file_s.append(time.perf_counter() - t0)
        for name, (path, per_lease, files) in variants.items():
            pool = TieredPool(BlockPool((n + 2) * nb),
                              DiskTier(str(directory), capacity, read_path=path),
                              queue_bytes=1 << 30)
            dropped = drop_caches() and dropped
            t0 = time.perf_counter()
            lease_s, got = fetch_leased(pool, keys, tokens, outs, per_lease, files)
            fetch[name].append(time.perf_counter() - t0)
            promote[name].append(lease_s)
            readable = min(readable, got)
            pool.close()
    plain.unlink()
    file_med = statistics.median(file_s)
    fetch_med = {k: statistics.median(v) for k, v in fetch.items()}
    promote_med = {k: statistics.median(v) for k, v in promote.items()}
    promoted = min(("promote_direct", "promote_buffered"), key=fetch_med.__getitem__)
    return {"block_nbytes": nb, "num_blocks": n, "read_rounds": rounds,
            "blocks_a_lease": lease_blocks, "page_cache_dropped": dropped,
            "file_read_layout": f"one file of {n} blocks vs {n} block files",
            "file_read_gbps": n * nb / file_med / 1e9,
            **{f"disk_read_gbps_{k}": n * nb / v / 1e9 for k, v in fetch_med.items()},
            **{f"disk_promote_gbps_{k}": n * nb / v / 1e9 for k, v in promote_med.items()},
            "disk_read_gbps": n * nb / fetch_med["files"] / 1e9,
            "ratio_disk_read_vs_file_read": file_med / fetch_med["files"],
            "ratio_disk_read_promoted_vs_file_read": file_med / fetch_med[promoted],
            "ratio_disk_promote_vs_file_read": file_med / promote_med[promoted],
            "disk_read_path": "files: the reader reads the block files into its buffers "
            "(O_DIRECT through an aligned buffer) and verifies them",
            "disk_promote_path": promoted.removeprefix("promote_"),
            "restart_recovered_ratio": min(recovered, readable) / n,
            "restart_recovery_s": recovery_s}


_WRITER = """
import sys
sys.path.insert(0, {root!r})
from benchmarks.bench_tier import make_big_blocks
from kvstore.node.disk_tier import DiskTier
keys, _, blocks = make_big_blocks(16)
disk = DiskTier({directory!r}, 1 << 30)
print("ready", flush=True)
while True:
    for k, b in zip(keys, blocks):
        disk.delete(k)
        disk.write(k, b, k, k)
"""


def bench_kills(quick: bool, workdir: Path) -> dict[str, float]:
    keys, tokens, blocks = make_big_blocks(16)
    by_key = dict(zip(keys, zip(tokens, blocks, strict=True), strict=True))
    directory = workdir / "kills"
    rounds = 5 if quick else 20
    torn = exposed = 0
    rng = random.Random(3)
    for _ in range(rounds):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(
            root=str(REPO), directory=str(directory))], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()
        time.sleep(rng.uniform(0.05, 0.5))
        proc.kill()
        proc.wait()
        disk = DiskTier(str(directory), 1 << 30)
        for key in disk.keys():
            entry = disk.entry(key)
            buf = bytearray(entry.nbytes if entry else 0)
            exposed += 1
            try:
                disk.read_into(key, memoryview(buf))
                verify_block(buf, BIG_NS, key, by_key[key][0])
            except Exception:
                torn += 1
        disk.close()
    return {"kill_rounds": rounds, "blocks_exposed_after_kills": exposed,
            "torn_blocks_after_kill": torn}


def main() -> None:
    args = parse_args("the disk tier: trace hit rate, disk reads, restart, kills",
                      lambda p: p.add_argument("--dir", help="work directory on the disk to "
                                               "measure (default: a temp dir)"))
    torch.set_num_threads(1)
    np.random.seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = Path(tmp)
        figures: dict[str, object] = {}
        figures.update(bench_trace(args.quick, workdir))
        figures.update(bench_reads_and_restart(args.quick, workdir))
        figures.update(bench_kills(args.quick, workdir))
        figures.update(bench_warm_ttft(args.quick, workdir, drop_caches))
    f = figures
    rows = [
        ("trace hit rate: tiered (10% arena + 100% disk)", f"{f['hit_rate_tiered']:.3f}",
         f"exact LRU {f['hit_rate_exact_lru_combined']:.3f}"),
        ("ratio_hit_vs_lru_tiered", f"{f['ratio_hit_vs_lru_tiered']:.3f}", ">= 0.95"),
        ("hit_rate_arena_only", f"{f['hit_rate_arena_only']:.3f}", "-"),
        ("wrong_blocks", str(f["wrong_blocks"]), "0"),
        ("replay (s) / the trace's own span (s); waits for the disk; blocks the tier dropped",
         f"{f['replay_s']:.0f} / {f['trace_span_s']:.0f}; {f['demotion_queue_waits']}; "
         f"{f['tier_drops']}", "-"),
        ("same-node disk fetch (GB/s): files / files 1 a lease / promoted direct / buffered",
         f"{f['disk_read_gbps_files']:.2f} / {f['disk_read_gbps_files_one_a_lease']:.2f} / "
         f"{f['disk_read_gbps_promote_direct']:.2f} / "
         f"{f['disk_read_gbps_promote_buffered']:.2f}", f"file read {f['file_read_gbps']:.2f}"),
        ("ratio_disk_read_vs_file_read (cold blocks: read from their files)",
         f"{f['ratio_disk_read_vs_file_read']:.2f}",
         ">= 0.8" + ("" if f["page_cache_dropped"] else " (page cache NOT dropped)")),
        (f"ratio_disk_read_promoted_vs_file_read (hot or remote: {f['disk_promote_path']})",
         f"{f['ratio_disk_read_promoted_vs_file_read']:.2f}", "-"),
        ("ratio_disk_promote_vs_file_read (the node's promotion alone)",
         f"{f['ratio_disk_promote_vs_file_read']:.2f}", "-"),
        ("restart_recovered_ratio", f"{f['restart_recovered_ratio']:.3f}", ">= 0.99"),
        ("restart_recovery_s", f"{f['restart_recovery_s']:.3f}", "-"),
        ("torn_blocks_after_kill", str(f["torn_blocks_after_kill"]),
         f"0 of {f['blocks_exposed_after_kills']} exposed"),
        (f"warm TTFT (s), {f['ttft_model']}, {f['ttft_shared_prompt_tokens']}-token prompt: disk",
         f"{f['warm_ttft_disk_s']:.3f}", f"arena {f['warm_ttft_arena_s']:.3f}"),
        ("ratio_warm_ttft_disk_vs_arena", f"{f['ratio_warm_ttft_disk_vs_arena']:.2f}",
         "<= 2" + ("" if f["ttft_page_cache_dropped"] else " (page cache NOT dropped)")),
        ("warm outputs equal use_cache=False", str(f["ttft_outputs_equal_no_cache"]), "True"),
    ]
    report("bench_tier: the disk tier", rows, figures, args.json)


if __name__ == "__main__":
    main()
