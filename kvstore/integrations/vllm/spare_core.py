"""Synchronous loads on a core the forward does not use, layer by layer under it (vLLM on a CPU).

vLLM on a CPU pins its forward to the cores ``VLLM_CPU_OMP_THREADS_BIND`` names. A load done on
those cores before the forward (fetch, check, write) adds its whole time to the request's; a
loader thread on the same cores takes the forward's time instead of hiding under it. Where the
process may also run on a core the forward does not use, one loader thread is pinned there and
does all of a step's synchronous loads while the forward runs:

- blocks a scheduler's lookup leased on this host's node are written straight from the arena
  (``ClusterStore.arena_blocks``: headers checked first, no copy of their own), layer after
  layer, each layer's event set once every load of the step is in it, so the attention of
  layer ``i`` (``wait``) waits for layer ``i`` alone;
- their tags are checked over the same leased bytes once every layer is written, while the
  forward still runs, and a block whose tag fails becomes a load error (``failed``): vLLM
  then discards that step's output for the request and recomputes from that block, so no
  token is ever sampled from it;
- anything else (no lease, a lease gone stale, remote holders) is fetched, checked and then
  written, on the same thread (``fetch``).

The loader's own work is copies and hashes that leave Python's lock to the forward while they
run, a few calls per layer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.client.shm_reader import detached
from kvstore.integrations.vllm.paged_layout import (
    LayerCache,
    ScatterPlan,
    plan_scatter,
    scatter_layer,
)
from kvstore.integrations.vllm.plans import BlockTransfer

log = logging.getLogger(__name__)


def spare_cores(others: frozenset[int] | None = frozenset()) -> set[int]:
    """CPUs this process may use that the calling thread (vLLM's forward, once vLLM pinned it)
    does not, nor ``others`` (the forwards of the instance's other ranks, ``forward_cores``;
    None: unknown, so none is spare); empty where the forward may run
    anywhere."""
    if others is None:
        return set()
    try:
        forward = os.sched_getaffinity(0)  # the calling thread's
    except (AttributeError, OSError):
        return set()
    return _process_cpus() - forward - others


def forward_cores(world_size: int, bind: str | None = None) -> frozenset[int] | None:
    """The cores vLLM binds this host's forwards to, every rank's, as
    ``VLLM_CPU_OMP_THREADS_BIND`` (``bind``) names them: a CPU list per rank, ``|`` between
    them (``0-3|4-7``). With vLLM's automatic binding (a NUMA node per rank) or none: for one
    rank, none beyond the calling thread's own (``spare_cores`` asks it); for several, None:
    unknown, so no core counts as spare."""
    mask = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") if bind is None else bind
    if mask in ("auto", "nobind"):
        return frozenset() if world_size == 1 else None
    cores: set[int] = set()
    for text in mask.split("|"):
        cores.update(_cpu_list(text))
    return frozenset(cores)


def _cpu_list(text: str) -> set[int]:
    """``0-3,8`` as {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_thread(cores: set[int]) -> None:
    """Run the calling thread (only it, not its process) on ``cores``."""
    os.sched_setaffinity(0, cores)


def _process_cpus() -> set[int]:
    """The CPUs the process's cgroup allows, else every online one."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return _cpu_list(text) or set(range(os.cpu_count() or 1))


@dataclass
class _Load:
    """One transfer's part of a step: where its payloads go, and what to check after."""

    transfer: BlockTransfer
    writes: list[tuple[ScatterPlan, torch.Tensor]]
    arena: Any = None  # ArenaBlocks: tags checked after the writes, lease ended then


class SpareCoreStep:
    """One step's synchronous loads on the loader thread; the interface of the worker's
    layer-by-layer loads (``wait``, ``done``, ``waited``, ``block_ids``, ``error``) plus
    ``failed``: the vLLM blocks whose tags failed once written."""

    def __init__(self, num_layers: int, transfers: Sequence[BlockTransfer]) -> None:
        self.done = [threading.Event() for _ in range(num_layers)]
        self.waited: set[int] = set()
        self.block_ids = [b for t in transfers for b in t.block_ids]
        self.error: BaseException | None = None
        self.failed: list[int] = []
        self.loaded = 0
        self.future: Future[None] | None = None

    def wait(self, index: int) -> None:
        """Until layer ``index`` is written."""
        self.done[index].wait()

    def join(self) -> None:
        """Until the step's writes and checks are over."""
        if self.future is not None:
            self.future.result()


class SpareCoreLoader:
    """The loader thread, pinned to ``cores`` (those the forward does not use)."""

    def __init__(self, cores: set[int]) -> None:
        self.cores = set(cores)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-spare")
        self.pinned = self._pool.submit(self._pin).result()

    def _pin(self) -> bool:
        try:
            pin_thread(self.cores)
        except OSError as exc:
            log.info("kvstore: cannot run loads on cores %s (%s); loading before the forward",
                     sorted(self.cores), exc)
            return False
        return True

    def executor(self, name: str) -> ThreadPoolExecutor:
        """A one-thread pool whose thread runs on the same spare cores (the asynchronous
        loads', the saves'): their copies and puts then leave the forward's cores alone too."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                  initializer=pin_thread, initargs=(self.cores,))

    def start(self, store: Any, namespace_of: Callable[..., Any],
              layers: Sequence[LayerCache], transfers: list[BlockTransfer],
              fetch: Callable[[list[BlockTransfer]], list[Any]]) -> SpareCoreStep:
        """Begin a step's loads; ``fetch(transfers)``: the worker's fetch of those it cannot
        write from the arena (its ``Fetched`` results, errors already reported)."""
        step = SpareCoreStep(len(layers), transfers)
        # The headers are checked here, before the forward starts: a fraction of a
        # millisecond, which on the loader thread took several times as long (sharing
        # Python's lock with the forward) while the forward's first layer waited for it.
        loads: list[_Load] = []
        try:
            rest = _in_place(store, namespace_of, layers[0], transfers, loads)
        except Exception:  # the arena unreadable: the usual reads on the loader thread
            log.exception("kvstore: reading leased blocks in place failed; fetching them")
            for load in loads:
                load.arena.close()
            loads, rest = [], transfers
        step.future = self._pool.submit(self._run, step, layers, loads, rest, fetch)
        return step

    def _run(self, step: SpareCoreStep, layers: Sequence[LayerCache], loads: list[_Load],
             rest: list[BlockTransfer], fetch: Callable[[list[BlockTransfer]], list[Any]]
             ) -> None:
        try:
            for fetched in fetch(rest) if rest else []:
                if fetched.payloads is not None:
                    plan = plan_scatter(layers[0], fetched.block_ids)
                    loads.append(_Load(fetched.transfer, [(plan, fetched.payloads)]))
            for i, layer in enumerate(layers):
                for load in loads:
                    for plan, payloads in load.writes:
                        scatter_layer(layer, i, plan, payloads)
                step.done[i].set()
            for load in loads:
                step.loaded += sum(len(plan.block_ids) for plan, _ in load.writes)
                if load.arena is not None:
                    good = load.arena.verify()
                    if good < len(load.arena):
                        log.warning("kvstore: %d of %d blocks of %s failed their check once "
                                    "written; vLLM recomputes them", len(load.arena) - good,
                                    len(load.arena), load.transfer.request_id)
                        step.failed += load.transfer.block_ids[good:]
        except Exception as exc:  # every block of the step becomes a load error
            log.exception("kvstore: loading on the spare core failed; vLLM recomputes")
            step.error = detached(exc)  # its frames hold views of the arena
        finally:
            for load in loads:
                if load.arena is not None:
                    load.arena.close()
            for event in step.done:
                event.set()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _in_place(store: Any, namespace_of: Callable[..., Any], first: LayerCache,
              transfers: list[BlockTransfer], loads: list[_Load]) -> list[BlockTransfer]:
    """Adds to ``loads`` the transfers whose every block the scheduler's lease pins in this
    host's arena, as writes from there; returns the others, to fetch."""
    rest: list[BlockTransfer] = []
    in_arena = getattr(store, "arena_blocks", None)
    for t in transfers:
        arena = None
        if t.lease is not None and in_arena is not None:
            arena = in_arena(namespace_of(t.cache_salt, t.weights), t.keys, t.tokens, t.lease)
        if arena is None or len(arena) < len(t.keys):
            if arena is not None:  # part of it elsewhere: read it all the usual way
                arena.close()
                t.lease = None
            rest.append(t)
            continue
        t.lease = None  # the arena view holds it now, and ends it
        writes = [(plan_scatter(first, t.block_ids[at:at + len(payloads)]), payloads)
                  for at, payloads in arena.segments]
        loads.append(_Load(t, writes, arena))
    return rest
