"""A Ray driver the multi-host tests run inside the head host: snapshots, faults, recovery waits.

Run as ``python3 tests/multihost/probe.py COMMAND`` with ``RAY_ADDRESS`` set; prints one line
``PROBE=<json>``. Or ``probe.py serve``: one driver for the whole session reading one command a
line (a JSON argv) on stdin and answering each with one ``PROBE=`` line (``PROBE_ERROR=`` when
it raised). Doing the polling here (one ``ray.init``) instead of in pytest (a new driver per
poll, seconds each) keeps recovery times honest to about a tenth of a second, and the session
driver saves a driver start (several seconds on a busy box) per call.

    snapshot                      every store node: node id, IP, keys held, keys indexed
    kill-coordinator [--nodes N --before FILE]
                                  ray.kill(handle, no_restart=False): Ray restarts the actor;
                                  with --nodes, then wait-healthy, both timed from the kill
    wait-healthy --nodes N --before FILE [--gone ID...] [--timeout S] [--since T]
                                  N store nodes registered on N distinct IPs, none of the gone
                                  ones, and every node of FILE still alive holds and indexes at
                                  least what it held then (--since: wall time of the fault)
    wait-replicas [--count N]     N prefill/decode replica actors alive (a job is about to fetch)
    wait-reads --ip IP            the store node on IP served a read (a job is fetching from it)
    wait-dead --ip IP [--since T] Ray no longer lists the node on IP alive
    alive-ips                     the IPs of the Ray nodes alive
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

from kvstore.cluster.names import RAY_NAMESPACE, coordinator_handle, store_actor_name

PROBE_PREFIX = "PROBE="
#: The worker classes that kvstore.workers.replicas.replica.replica_actor runs as Ray actors.
REPLICA_CLASSES = ("PrefillWorker", "DecodeWorker")


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
                 gone: frozenset[str] = frozenset(), since: float | None = None
                 ) -> dict[str, Any]:
    """Poll until healthy; the elapsed time (since the wall time ``since`` too), the final
    snapshot and what was lost."""
    t0 = time.monotonic()
    now: dict[str, Any] = {}
    ok = False
    while time.monotonic() - t0 < timeout_s:
        ok, now = healthy(before, num_nodes, gone)
        if ok:
            break
        time.sleep(0.2)
    out = {"ok": ok, "elapsed_s": round(time.monotonic() - t0, 2), "snapshot": now}
    if since is not None:
        out["since_fault_s"] = round(time.time() - since, 2)
    if not ok:
        out["lost"] = lost_blocks(before, now) if "error" not in now else {}
        out["why"] = unhealthy_because(now, num_nodes, gone, out["lost"])
    return out


def unhealthy_because(now: dict[str, Any], num_nodes: int, gone: frozenset[str],
                      lost: dict[str, Any]) -> str:
    """One line first in a failure message (CI shows only its head): which condition failed."""
    if "error" in now:
        return f"no snapshot: {now['error']}"
    ips = sorted({n["ip"] for n in now.values()})
    reasons = []
    if len(now) != num_nodes or len(ips) != num_nodes:
        reasons.append(f"{len(now)} store nodes on {ips}, want {num_nodes}")
    if gone & set(now):
        reasons.append(f"gone nodes still registered: {sorted(gone & set(now))}")
    if lost:
        reasons.append(f"blocks lost: {lost}")
    return "; ".join(reasons)


def alive_ips() -> list[str]:
    """The addresses of the Ray nodes the GCS reports alive."""
    return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])


def wait_dead(ip: str, timeout_s: float, since: float | None = None) -> dict[str, Any]:
    """Wait until Ray declares the node on ``ip`` dead (health checks failed)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if ip not in alive_ips():
            out = {"after_s": round(time.monotonic() - t0, 2)}
            if since is not None:
                out["since_fault_s"] = round(time.time() - since, 2)
            return out
        time.sleep(0.2)
    raise TimeoutError(f"Ray still lists {ip} alive after {timeout_s}s")


def kill_coordinator(timeout_s: float = 60.0) -> dict[str, Any]:
    """Kill the coordinator actor and let Ray restart it; the time until it answers again."""
    handle = coordinator_handle()
    epoch = ray.get(handle.epoch.remote(), timeout=30)
    t0, killed_at = time.monotonic(), time.time()
    ray.kill(handle, no_restart=False)
    while time.monotonic() - t0 < timeout_s:
        try:
            new = ray.get(coordinator_handle().epoch.remote(), timeout=5)
        except Exception:  # restarting: the call fails or times out until it is back
            time.sleep(0.1)
            continue
        if new != epoch:
            return {"old_epoch": epoch, "new_epoch": new, "killed_at": killed_at,
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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe")
    parser.add_argument("command", choices=["snapshot", "kill-coordinator", "wait-healthy",
                                                "wait-replicas", "wait-reads", "wait-dead",
                                                "alive-ips", "serve"])
    parser.add_argument("--ip")
    parser.add_argument("--gone", nargs="*", default=[], help="node ids that must have left")
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=0)
    parser.add_argument("--before", help="a snapshot JSON file")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--since", type=float, help="wall time (time.time()) of the fault")
    return parser


def run_command(args: argparse.Namespace) -> Any:
    """One command's result (json-able)."""
    before = json.loads(open(args.before).read()) if args.before else {}
    if args.command == "snapshot":
        return snapshot()
    if args.command == "kill-coordinator":
        result = kill_coordinator(args.timeout)
        if args.nodes:  # the nodes re-announce: timed from the kill, in this same driver
            healthy_after = wait_healthy(before, args.nodes, args.timeout,
                                         since=result.pop("killed_at"))
            result.update(healthy=healthy_after)
        return result
    if args.command == "wait-reads":
        return wait_reads(args.ip, args.timeout)
    if args.command == "wait-replicas":
        return wait_replicas(args.count, args.timeout)
    if args.command == "wait-dead":
        return wait_dead(args.ip, args.timeout, args.since)
    if args.command == "alive-ips":
        return alive_ips()
    return wait_healthy(before, args.nodes, args.timeout, frozenset(args.gone), args.since)


def serve(parser: argparse.ArgumentParser) -> None:
    """Answer one command a line (a JSON argv) until stdin closes."""
    print(PROBE_PREFIX + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        try:
            result = run_command(parser.parse_args(json.loads(line)))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, who fails
            print("PROBE_ERROR=" + json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
            continue
        print(PROBE_PREFIX + json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    ray.init(address="auto", namespace=RAY_NAMESPACE, logging_level=logging.ERROR,
             log_to_driver=False)
    if args.command == "serve":
        serve(parser)
        return 0
    result = run_command(args)
    print(PROBE_PREFIX + json.dumps(result), flush=True)
    if args.command == "wait-reads":
        # The caller injects a fault the moment this returns: skip Ray's orderly shutdown.
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
