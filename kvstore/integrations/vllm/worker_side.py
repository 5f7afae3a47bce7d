"""The connector's worker side: fetched blocks into vLLM's paged KV, computed blocks out of it.

Loads come in two kinds, chosen per request by the scheduler side (``BlockTransfer.asynchronous``):

- **synchronous** (the forward of this step needs them): on a GPU ``start_load_kv`` fetches
  and verifies the blocks (``batch_get``) and a loader thread writes them with
  ``kv_cache_scatter`` layer by layer while the forward runs, the attention of layer ``i``
  waiting only for layer ``i`` (``wait_for_layer_load``), so the writes of later layers overlap
  the forward of earlier ones; on a CPU the same, all of it on a thread pinned to a core the
  forward does not use, writing leased blocks straight from the arena (``spare_core``), or,
  with no such core, whole before the forward (a writer thread on the forward's own cores
  takes their time instead of hiding under it: ``WorkerSide``);
- **asynchronous** (the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` while other requests
  go on decoding): fetch and write run on a thread of their own, and ``get_finished`` reports
  the request once its blocks are in.

Only a leading run of verified blocks is written; every vLLM block of a transfer from its first
miss on (a corrupted block, a dead holder, a cluster that went away) is reported as a load
error, so vLLM recomputes those tokens and the request never sees wrong KV. Saves gather the
plan's blocks with ``paged_cache_load`` and put them from a background thread, off the forward
path; ``close`` waits for the puts still queued. On a GPU the gather is queued on the forward's
stream in ``wait_for_save``, right behind the forward that completed the blocks. On a CPU it is
work on the core that computes, so it waits until the step's output is out: the save thread
gathers once the engine is idle (``SAVE_DEFER_S``), and at the latest ``before_step`` (vLLM's
``handle_preemptions``, the first thing of the next step, before vLLM zeroes or writes any
block it reallocated) gathers whatever is still waiting: a request's first token no longer
waits for its blocks' gather.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvstore.api import BlockPut, FetchedBlock
from kvstore.block import block_nbytes, payload_offset
from kvstore.client.block_buffers import new_rows
from kvstore.client.verify_pool import cap_threads
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.layer_loads import Fetched, LayerLoads, on_cuda, touched_rows
from kvstore.integrations.vllm.paged_layout import (
    LayerCache,
    gather_blocks,
    layer_cache,
    scatter_blocks,
)
from kvstore.integrations.vllm.plans import BlockTransfer, StepPlan
from kvstore.integrations.vllm.spare_core import SpareCoreLoader, SpareCoreStep, spare_cores
from kvstore.integrations.vllm.transfer_tally import TransferTally
from kvstore.keys import Namespace

log = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(name: str) -> tuple[int, str]:
    """Sort key of a vLLM attention layer name (``model.layers.12.self_attn.attn``)."""
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else -1, name)


class _PendingSave:
    """A save whose blocks are still to be gathered out of vLLM's caches (CPU caches: after
    the step's output, ``WorkerSide.before_step`` at the latest)."""

    def __init__(self, transfer: BlockTransfer) -> None:
        self.transfer = transfer
        self.payloads: torch.Tensor | None = None
        self.lock = threading.Lock()
        self.dropped = False  # its blocks may have been overwritten: never put

    def gather(self, layers: Sequence[LayerCache]) -> torch.Tensor:
        with self.lock:
            if self.dropped:
                raise RuntimeError("its blocks were reused before they were gathered")
            if self.payloads is None:
                self.payloads = gather_blocks(layers, self.transfer.block_ids)
            return self.payloads


#: The synchronous loads' fetch buffer, made and touched when the caches are registered: this
#: many blocks (a 2,048-token prefix at vLLM's block size 32), at most this many bytes.
PRELOAD_ROWS = 64
PRELOAD_BYTES = 64 << 20


#: The longest a put waits for the step that completed its blocks to hand its output back
#: (it waits for the next step's start; this is for an engine left idle).
SAVE_DEFER_S = 0.005


def as_namespace_dtype(name: str, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Layer ``name``'s cache as the namespace's dtype: the blocks' bytes are the cache's, never
    converted on the way. vLLM stores fp8 caches as bytes (a backend may hand them over as a
    float8 dtype: the same bytes, viewed as ``uint8``); any other dtype is refused."""
    if cache.dtype == dtype:
        return cache
    if dtype == torch.uint8 and cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8)
    raise ConfigError(f"vLLM's KV cache of {name} is {cache.dtype}, not the {dtype} its "
                      "kv_cache_dtype says: kvstore cannot hold it")


class WorkerSide:
    """Executes step plans against one instance's caches and a kvstore store."""

    def __init__(self, store: Any, namespace_of: Callable[..., Namespace],
                 num_kv_heads: int, head_dim: int, *, layerwise: bool | None = None,
                 forward_cores: frozenset[int] | None = frozenset()) -> None:
        """``layerwise``: write synchronous loads layer by layer under the forward (True) or
        whole before it (False); None: by the caches' device (``register``): layer by layer
        on a GPU, where the writes are copies on a stream of their own; on a CPU, layer by
        layer where the process may run on a core the forward does not use (``spare_core``),
        else whole before the forward, as a writer thread on the forward's own cores takes
        their time instead of hiding under it (docs/vllm-measurements.md). ``forward_cores``:
        every rank's forward cores (``spare_core.forward_cores``; None: unknown), never
        spare."""
        self.store = store
        self.forward_cores = forward_cores
        self.namespace_of = namespace_of
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.layerwise = layerwise
        self.layers: list[LayerCache] = []
        self._layer_index: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self._step: LayerLoads | SpareCoreStep | None = None
        self._spare: SpareCoreLoader | None = None
        self._scatters = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix="kvstore-vllm-scatter")
        self._async_loads = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="kvstore-vllm-load")
        self._receiving: dict[str, Future[None]] = {}
        self._puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-vllm-save")
        self._pending: list[Future[None]] = []
        self._ungathered: list[_PendingSave] = []  # CPU saves not gathered yet (before_step)
        self.defer_gathers = True  # False once a step began without ``before_step``
        self._step_began = threading.Event()  # set: queued puts may run (``save``)
        self._step_began.set()
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self.tally = TransferTally()  # for vLLM's statistics (get_kv_connector_stats)

    @property
    def loaded_blocks(self) -> int:
        return int(self.tally.total("loaded_blocks"))

    @property
    def saved_blocks(self) -> int:
        return int(self.tally.total("saved_blocks"))

    def _count(self, kind: str, num_blocks: int) -> None:
        """``num_blocks`` blocks ``loaded`` into or ``saved`` out of vLLM's caches."""
        self.tally.add(f"{kind}_blocks", num_blocks)
        self.tally.add(f"{kind}_bytes", num_blocks * self.namespace_of("").payload_nbytes)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer caches, in layer order; connects to the store node now, so the
        first request does not pay for it, and on a CPU starts mapping its arena (off the
        forward's cores where there are spare ones), so loads take no page faults."""
        names = sorted(kv_caches, key=layer_order)
        self.layers = [layer_cache(as_namespace_dtype(name, kv_caches[name],
                                                      self.namespace_of("").torch_dtype),
                                   self.num_kv_heads, self.head_dim) for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        on_cpu = bool(self.layers) and not on_cuda(self.layers[0].key.device)
        if on_cpu and self.layerwise is not False and self._spare is None:
            cores = spare_cores(self.forward_cores)  # vLLM pinned this thread by now
            spare = SpareCoreLoader(cores) if cores else None
            if spare is not None and not spare.pinned:
                spare.close()
                spare = None
            self._spare = spare
            if spare is not None:  # nothing ran on these yet: their threads start there
                self._async_loads.shutdown()
                self._puts.shutdown()
                self._async_loads = spare.executor("kvstore-vllm-load")
                self._puts = spare.executor("kvstore-vllm-save")
        if self.layerwise is None and self.layers:
            self.layerwise = not on_cpu or self._spare is not None
        if on_cpu:
            # A read's copy and check go on the calling thread: in vLLM's process a helper
            # thread bought nothing (the caller waited on the GIL for its share)
            cap_threads(1)
            nbytes = block_nbytes(self.namespace_of(""))
            self._buffer = touched_rows(max(1, min(PRELOAD_ROWS, PRELOAD_BYTES // nbytes)),
                                        nbytes)
        warm_up = getattr(self.store, "warm_up", None)  # ClusterStore; LocalStore has none
        if warm_up is not None:
            warm_up()
        populate = getattr(self.store, "populate_arena", None)
        if on_cpu and populate is not None:  # loads copy out of the arena: no page faults
            populate(None if self._spare is None else self._spare.cores)

    # -- loads ---------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """Start the step's loads: asynchronous ones on their thread; synchronous ones fetched
        now and written layer by layer (``wait_for_layer``). The last step's output is out by
        now: its queued puts may start (``save``)."""
        self._step_began.set()
        self._drop_ungathered()
        for t in plan.loads:
            if t.asynchronous:
                self._receiving[t.request_id] = self._async_loads.submit(self._load_whole, t,
                                                                         None)
        sync = [t for t in plan.loads if not t.asynchronous]
        if not sync:
            return
        if self.layerwise and self._spare is not None:  # all of it on the spare core
            self._step = self._spare.start(self.store, self.namespace_of, self.layers, sync,
                                           self._fetch_step)
            return
        fetched = self._fetch_step(sync)
        self._count("loaded", sum(len(f.block_ids) for f in fetched))
        if not self.layerwise:
            for f in fetched:
                if f.payloads is not None:
                    scatter_blocks(self.layers, f.block_ids, f.payloads)
            return
        self._step = LayerLoads(self.layers, fetched)
        self._scatters.submit(self._step.run)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's synchronous loads are written into ``layer_name``."""
        step = self._step
        index = self._layer_index.get(layer_name)
        if step is None or index is None:
            return
        step.wait(index)
        step.waited.add(index)

    def finish_loads(self) -> None:
        """After the forward: the step's layer writes are over. A layer the forward did not
        wait for may have been read half written, so its blocks become load errors (vLLM
        recomputes them) and loads are written whole before the forward from then on."""
        step, self._step = self._step, None
        if step is None:
            return
        for i in range(len(step.done)):
            step.wait(i)
        if isinstance(step, SpareCoreStep):
            step.join()
            self._count("loaded", step.loaded)
            self._add_errors(step.failed)
        if step.error is not None:
            self._add_errors(step.block_ids)
        elif len(step.waited) < len(self.layers):
            log.warning("vLLM did not wait for every layer's load (%d of %d); loading whole "
                        "before the forward from now on", len(step.waited), len(self.layers))
            self.layerwise = False
            self._add_errors(step.block_ids)

    def finished_receiving(self) -> set[str]:
        """Requests whose asynchronous loads are over (their errors already reported)."""
        done = {rid for rid, future in self._receiving.items() if future.done()}
        for rid in done:
            self._receiving.pop(rid).result()
        return done

    def _load_whole(self, t: BlockTransfer, out: torch.Tensor | None) -> None:
        try:
            device = self.layers[0].key.device
            if on_cuda(device):
                torch.cuda.set_device(device)
            [fetched] = self._fetch_step([t], out)
            if fetched.payloads is not None:
                scatter_blocks(self.layers, fetched.block_ids, fetched.payloads)
            if on_cuda(device):  # written before vLLM is told, and schedules the request
                torch.cuda.current_stream(device).synchronize()
            self._count("loaded", len(fetched.block_ids))
        except Exception:  # never a failed request: vLLM recomputes the whole transfer
            log.exception("kvstore: loading %s failed; vLLM recomputes it", t.request_id)
            self._add_errors(t.block_ids)

    def _fetch_step(self, transfers: list[BlockTransfer],
                    out: torch.Tensor | None = None) -> list[Fetched]:
        """Fetch and verify each transfer; the blocks after its first miss are load errors."""
        on_device = bool(self.layers) and self.layers[0].key.device.type != "cpu"
        if out is None and transfers and not on_device and hasattr(self.store, "batch_get_into"):
            namespace = self.namespace_of(transfers[0].cache_salt)
            rows = sum(len(t.keys) for t in transfers)
            out = self._rows(rows, block_nbytes(namespace), shared=not transfers[0].asynchronous)
        fetched, row = [], 0
        started = time.perf_counter()
        for t in transfers:
            part = None if out is None else out[row:row + len(t.keys)]
            row += len(t.keys)
            fetched.append(self._fetch(t, part))
        self.tally.add("fetch_seconds", time.perf_counter() - started)
        return fetched

    def _rows(self, rows: int, nbytes: int, *, shared: bool) -> torch.Tensor:
        """Fetch rows: one buffer reused by synchronous loads (its pages are already mapped),
        a fresh one for each asynchronous load (they overlap)."""
        if not shared:
            return new_rows(rows, nbytes)
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != nbytes:
            grown = 0 if buffer is None or buffer.shape[1] != nbytes else 2 * buffer.shape[0]
            buffer = self._buffer = touched_rows(max(rows, grown), nbytes)
        return buffer

    def _fetch(self, t: BlockTransfer, out: torch.Tensor | None) -> Fetched:
        namespace = self.namespace_of(t.cache_salt, t.weights)
        view = getattr(self.store, "view", None)  # ClusterStore's IndexView
        if t.holders is not None and view is not None:
            view.remember(t.keys, t.holders)  # the scheduler's lookup: no second index call
        held = {} if t.lease is None else {"held": t.lease}  # the scheduler's lookup's lease
        try:
            if out is not None:
                results = self.store.batch_get_into(namespace, t.keys, t.tokens, out, **held)
            elif self.layers and self.layers[0].key.device.type != "cpu":
                # Verified, then copied to the caches' device (same node: DMA from the arena).
                results = self.store.batch_get(namespace, t.keys, t.tokens,
                                               device=self.layers[0].key.device, **held)
            else:
                results = self.store.batch_get(namespace, t.keys, t.tokens, **held)
        except Exception as exc:  # the store's, Ray's or gRPC's: a miss, never a failure
            log.warning("kvstore fetch for %s failed; vLLM recomputes: %s", t.request_id, exc)
            results = []
        good = 0
        while good < len(results) and isinstance(results[good], FetchedBlock):
            good += 1
        if good < len(t.block_ids):
            log.warning("kvstore: %d of %d blocks of %s not loaded; vLLM recomputes them",
                        len(t.block_ids) - good, len(t.block_ids), t.request_id)
            self._add_errors(t.block_ids[good:])
        if not good:
            return Fetched(t, None)
        if out is None:
            return Fetched(t, torch.stack([r.payload for r in results[:good]]))
        start = payload_offset(namespace)  # the rows' payloads, viewed, never copied
        payloads = out[:good, start:start + namespace.payload_nbytes] \
            .view(namespace.torch_dtype).unflatten(1, namespace.payload_shape)
        return Fetched(t, payloads)

    def _add_errors(self, block_ids: Sequence[int]) -> None:
        with self._errors_lock:
            self._load_errors.update(block_ids)
        self.tally.add("load_failed_blocks", len(block_ids))

    def load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Save the plan's blocks: gathered now on a GPU (queued behind the forward), later on
        a CPU (``before_step``); put from the save thread once this step's output is out: at
        the next step's start, or after ``SAVE_DEFER_S`` when no step follows. On the cores
        vLLM runs on, a gather or a put started at once would share them with the end of the
        step that completed the request."""
        if plan.saves:
            self._step_began.clear()
        on_gpu = bool(self.layers) and on_cuda(self.layers[0].key.device)
        for t in plan.saves:
            pending = _PendingSave(t)
            if on_gpu or not self.defer_gathers:
                pending.gather(self.layers)  # kernels on the forward's stream, behind it
            else:
                with self._lock:
                    self._ungathered.append(pending)
            future = self._puts.submit(self._put, pending)
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()] + [future]

    def before_step(self) -> None:
        """The next step begins (vLLM's ``handle_preemptions``, before it zeroes reallocated
        blocks or writes any): gather every save still waiting, while its blocks still hold
        its KV, and let queued puts run."""
        self._step_began.set()
        with self._lock:
            waiting, self._ungathered = self._ungathered, []
        for pending in waiting:
            pending.gather(self.layers)

    def _drop_ungathered(self) -> None:
        """A step began with saves still waiting: vLLM did not call ``before_step`` (a version
        without ``handle_preemptions``), so their blocks may hold another request's KV by now.
        They are dropped, never put, and later saves are gathered in ``wait_for_save``."""
        with self._lock:
            stale, self._ungathered = self._ungathered, []
        if not stale:
            return
        for pending in stale:
            with pending.lock:
                pending.dropped = pending.payloads is None
        if self.defer_gathers:
            log.warning("kvstore: vLLM began a step without handle_preemptions; %d saves "
                        "dropped, later ones are gathered before the step's output",
                        len(stale))
            self.defer_gathers = False

    def _put(self, pending: _PendingSave) -> None:
        t = pending.transfer
        self._step_began.wait(SAVE_DEFER_S)
        try:
            payloads = pending.gather(self.layers)  # at once if before_step already did
            puts = [BlockPut(k, p, tok, payloads[i]) for i, (k, p, tok)
                    in enumerate(zip(t.keys, t.parents, t.tokens, strict=True))]
            self.store.batch_put(self.namespace_of(t.cache_salt, t.weights), puts)
            self._count("saved", len(puts))
        except Exception as exc:  # a cache that misses later, never a failed request
            if pending.dropped:
                return  # said once, in _drop_ungathered
            log.warning("kvstore: saving %d blocks of %s failed: %s", len(t.keys),
                        t.request_id, exc)

    def flush(self) -> None:
        """Wait for every queued put."""
        self.before_step()
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.finish_loads()
        for future in list(self._receiving.values()):
            future.exception()
        self.flush()
        for pool in (self._scatters, self._async_loads, self._puts):
            pool.shutdown(wait=True)
        if self._spare is not None:
            self._spare.close()
