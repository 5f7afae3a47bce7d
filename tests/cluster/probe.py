"""A Ray driver the multi-host tests run inside the head host: snapshots, faults, recovery waits.

Run as ``python3 tests/cluster/probe.py COMMAND`` with ``RAY_ADDRESS`` set; prints one line
``PROBE=<json>``. Doing the polling here (one ``ray.init``) instead of in pytest (a new driver
per poll, seconds each) keeps recovery times honest to about a tenth of a second.

    snapshot                      every store node: node id, IP, keys held, keys indexed
    kill-coordinator              ray.kill(handle, no_restart=False): Ray restarts the actor
    wait-healthy --nodes N --before FILE [--gone ID...] [--timeout S]
                                  N store nodes registered on N distinct IPs, none of the gone
                                  ones, and every node of FILE still alive holds and indexes at
                                  least what it held then
    wait-replicas [--count N]     N prefill/decode replica actors alive (a job is about to fetch)
    wait-reads --ip IP            the store node on IP served a read (a job is fetching from it)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import ray

from kvstore.cluster import RAY_NAMESPACE, coordinator_handle, store_actor_name

PROBE_PREFIX = "PROBE="
#: The classes behind workers.prefill.PrefillWorker and workers.decode.DecodeWorker.
REPLICA_CLASSES = ("PrefillReplica", "DecodeReplica")


def snapshot() -> dict[str, Any]:
    """``{node_id: {ip, held, indexed}}`` for the coordinator's live store nodes (keys as hex)."""
    coord = coordinator_handle()
    directory = ray.get(coord.directory.remote(), timeout=30)
    out: dict[str, Any] = {}
    for node_id, addr in directory.items():
        try:
            actor = ray.get_actor(store_actor_name(node_id), namespace=RAY_NAMESPACE)
            held = sorted(k.hex() for k in ray.get(actor.keys.remote(), timeout=10))
        except Exception as exc:  # a node dying under us: report it, the caller decides
            held = [f"error: {type(exc).__name__}"]
        indexed = sorted(k.hex() for k in ray.get(coord.keys_of_node.remote(node_id),
                                                  timeout=30))
        out[node_id] = {"ip": addr.grpc_address.rpartition(":")[0], "held": held,
                        "indexed": indexed}
    return out


def lost_blocks(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per node alive in both: blocks held before that are no longer held, or no longer indexed."""
    lost = {}
    for node_id, was in before.items():
        now = after.get(node_id)
        if now is None:
            continue  # the node died: its blocks leaving is the design, not a loss
        held = set(was["held"])
        gone_held = len(held - set(now["held"]))
        gone_indexed = len(held - set(now["indexed"]))
        if gone_held or gone_indexed:
            lost[node_id] = {"not_held": gone_held, "not_indexed": gone_indexed}
    return lost


def healthy(before: dict[str, Any], num_nodes: int, gone: frozenset[str] = frozenset()
            ) -> tuple[bool, dict[str, Any]]:
    """Whether ``num_nodes`` store nodes on distinct IPs serve (none of the ``gone`` nodes) and
    no live node lost a block."""
    try:
        now = snapshot()
    except Exception as exc:  # coordinator restarting, node lookups failing: not yet
        return False, {"error": f"{type(exc).__name__}: {exc}"}
    ips = {n["ip"] for n in now.values()}
    return len(now) == num_nodes and len(ips) == num_nodes and not gone & set(now) \
        and not lost_blocks(before, now), now


def wait_healthy(before: dict[str, Any], num_nodes: int, timeout_s: float,
                 gone: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Poll until healthy; the elapsed time, the final snapshot and what was lost."""
    t0 = time.monotonic()
    now: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout_s:
        ok, now = healthy(before, num_nodes, gone)
        if ok:
            return {"ok": True, "elapsed_s": round(time.monotonic() - t0, 2), "snapshot": now}
        time.sleep(0.2)
    lost = lost_blocks(before, now) if "error" not in now else {}
    return {"ok": False, "elapsed_s": round(time.monotonic() - t0, 2), "snapshot": now,
            "lost": lost}


def kill_coordinator(timeout_s: float = 60.0) -> dict[str, Any]:
    """Kill the coordinator actor and let Ray restart it; the time until it answers again."""
    handle = coordinator_handle()
    epoch = ray.get(handle.epoch.remote(), timeout=30)
    t0 = time.monotonic()
    ray.kill(handle, no_restart=False)
    while time.monotonic() - t0 < timeout_s:
        try:
            new = ray.get(coordinator_handle().epoch.remote(), timeout=5)
        except Exception:  # restarting: the call fails or times out until it is back
            time.sleep(0.1)
            continue
        if new != epoch:
            return {"old_epoch": epoch, "new_epoch": new,
                    "answers_after_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)
    raise TimeoutError(f"coordinator did not come back within {timeout_s}s")


def wait_replicas(count: int, timeout_s: float) -> dict[str, Any]:
    """Wait until ``count`` prefill/decode replica actors are alive (a job is about to fetch)."""
    from ray.util.state import list_actors

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                 if a.class_name in REPLICA_CLASSES]
        if len(alive) >= count:
            return {"alive": len(alive), "after_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} replicas alive after {timeout_s}s")


def wait_reads(ip: str, timeout_s: float) -> dict[str, Any]:
    """Wait until the store node on ``ip`` serves a read (a job is fetching from it now)."""
    (node_id,) = [n for n, node in snapshot().items() if node["ip"] == ip]
    actor = ray.get_actor(store_actor_name(node_id), namespace=RAY_NAMESPACE)
    baseline = ray.get(actor.stats.remote(), timeout=10).hits
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        hits = ray.get(actor.stats.remote(), timeout=10).hits
        if hits > baseline:
            return {"node_id": node_id, "hits": hits - baseline,
                    "after_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.02)
    raise TimeoutError(f"no read served by {ip} within {timeout_s}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe")
    parser.add_argument("command", choices=["snapshot", "kill-coordinator", "wait-healthy",
                                                "wait-replicas", "wait-reads"])
    parser.add_argument("--ip")
    parser.add_argument("--gone", nargs="*", default=[], help="node ids that must have left")
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--before", help="a snapshot JSON file")
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args(argv)
    ray.init(address="auto", namespace=RAY_NAMESPACE, logging_level=logging.ERROR,
             log_to_driver=False)
    if args.command == "snapshot":
        result: dict[str, Any] = snapshot()
    elif args.command == "kill-coordinator":
        result = kill_coordinator(args.timeout)
    elif args.command == "wait-reads":
        # The caller injects a fault the moment this returns: skip Ray's orderly shutdown.
        print(PROBE_PREFIX + json.dumps(wait_reads(args.ip, args.timeout)), flush=True)
        os._exit(0)
    elif args.command == "wait-replicas":
        result = wait_replicas(args.count, args.timeout)
    else:
        before = json.loads(open(args.before).read()) if args.before else {}
        result = wait_healthy(before, args.nodes, args.timeout, frozenset(args.gone))
    print(PROBE_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
