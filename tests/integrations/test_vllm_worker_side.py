"""The connector's worker side over a real LocalStore: blocks saved out of one instance's paged
caches load into another's bitwise (in the forward, layer by layer, or asynchronously), and a
block that cannot be loaded is reported for vLLM to recompute, never written."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvstore.api import MISS_NOT_FOUND, Miss
from kvstore.client.local_store import LocalStore
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.namespace import weights_fingerprint
from kvstore.integrations.vllm.plans import BlockTransfer, StepPlan
from kvstore.integrations.vllm.worker_side import WorkerSide, layer_order
from kvstore.keys import BlockHasher, Namespace

BS, H, D, L, NB = 4, 2, 8, 3, 6


def ns(salt: str, weights: str = "") -> Namespace:
    return Namespace(weights_fingerprint("e" * 64, weights), "float32", BS, L, H, D, salt)


def caches() -> dict[str, torch.Tensor]:  # the CPU backend's layout, one tensor per layer
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NB, H, BS, 2 * D) for i in range(L)}


def transfer(tokens: list[int], block_ids: list[int], rid: str = "r",
             asynchronous: bool = False, weights: str = "") -> BlockTransfer:
    keys = [bytes(k) for k in BlockHasher(ns("", weights)).block_keys(tokens)]
    return BlockTransfer(rid, "", keys, [ns("", weights).root, *keys[:-1]],
                         [tokens[i * BS:(i + 1) * BS] for i in range(len(keys))], block_ids,
                         asynchronous, weights=weights)


def registered_pair(store: LocalStore, namespace_of, src: dict[str, torch.Tensor],
                    dst: dict[str, torch.Tensor]) -> tuple[WorkerSide, WorkerSide]:
    """Two instances' worker sides on one store: a writer over ``src``, a reader over ``dst``."""
    writer, reader = WorkerSide(store, namespace_of, H, D), WorkerSide(store, namespace_of, H, D)
    writer.register(src)
    reader.register(dst)
    return writer, reader


def forward(worker: WorkerSide, layers: int = L) -> None:
    """What vLLM does around a forward: each attention layer waits for its load, in order."""
    for i in range(layers):
        worker.wait_for_layer(f"model.layers.{i}.self_attn.attn")
    worker.finish_loads()


def assert_loaded_blocks_4_1_into_0_5(reader: WorkerSide, src: dict[str, torch.Tensor],
                                     dst: dict[str, torch.Tensor]) -> None:
    """Run the forward of a load of source blocks 4 and 1 into blocks 0 and 5: bitwise."""
    forward(reader)
    assert reader.load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][0], src[name][4]) and torch.equal(dst[name][5], src[name][1])


def test_layers_are_ordered_by_index_not_by_name() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1)]
    assert sorted(names, key=layer_order) == [names[2], names[1], names[0]]


@pytest.mark.parametrize("layerwise", [True, False, None])
def test_saved_blocks_load_bitwise_into_another_instance(layerwise: bool | None) -> None:
    store = LocalStore()
    src, dst = caches(), caches()
    writer = WorkerSide(store, ns, H, D)
    reader = WorkerSide(store, ns, H, D, layerwise=layerwise)
    writer.register(src)
    reader.register(dst)
    # The default writes whole before the forward on a CPU (layer by layer only on a GPU).
    assert reader.layerwise is (False if layerwise is None else layerwise)
    tokens = list(range(8))
    writer.save(StepPlan(saves=[transfer(tokens, [4, 1])]))
    writer.flush()
    assert writer.saved_blocks == 2
    reader.load(StepPlan(loads=[transfer(tokens, [0, 5])]))
    assert_loaded_blocks_4_1_into_0_5(reader, src, dst)
    writer.close()
    reader.close()


def test_an_fp8_caches_bytes_load_bitwise_and_a_cache_of_another_dtype_is_refused() -> None:
    """vLLM's fp8 caches are bytes (uint8): saved and loaded as they are. A cache whose dtype
    is not the namespace's is refused at registration, never converted on the way."""
    def fp8_ns(salt: str, weights: str = "") -> Namespace:
        return Namespace(weights_fingerprint("e" * 64, weights), "uint8", BS, L, H, D, salt,
                         numerics="cpu|kv cache fp8_e4m3 of float32")

    def fp8_caches() -> dict[str, torch.Tensor]:
        return {name: torch.randint(0, 256, t.shape, dtype=torch.uint8)
                for name, t in caches().items()}

    store = LocalStore()
    src, dst = fp8_caches(), fp8_caches()
    writer, reader = registered_pair(store, fp8_ns, src, dst)
    tokens = list(range(8))
    keys = [bytes(k) for k in BlockHasher(fp8_ns("")).block_keys(tokens)]
    move = BlockTransfer("r", "", keys, [fp8_ns("").root, *keys[:-1]],
                         [tokens[:BS], tokens[BS:]], [4, 1], False)
    writer.save(StepPlan(saves=[move]))
    writer.flush()
    reader.load(StepPlan(loads=[dataclasses.replace(move, block_ids=[0, 5])]))
    assert_loaded_blocks_4_1_into_0_5(reader, src, dst)
    with pytest.raises(ConfigError, match="is torch.float32, not the torch.uint8"):
        WorkerSide(store, fp8_ns, H, D).register(caches())
    as_float8 = {name: t.view(torch.float8_e4m3fn) for name, t in fp8_caches().items()}
    viewer = WorkerSide(store, fp8_ns, H, D)  # a backend's float8 view: the same bytes
    viewer.register(as_float8)
    viewer.load(StepPlan(loads=[dataclasses.replace(move, block_ids=[0, 5])]))
    assert_loaded_blocks_4_1_into_0_5(viewer, src, {n: t.view(torch.uint8)
                                                    for n, t in as_float8.items()})
    viewer.close()
    writer.close()
    reader.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_blocks_from_the_first_miss_on_are_load_errors_and_stay_untouched(
        layerwise: bool) -> None:
    store = LocalStore()
    src, dst = caches(), caches()
    writer = WorkerSide(store, ns, H, D)
    reader = WorkerSide(store, ns, H, D, layerwise=layerwise)
    writer.register(src)
    reader.register(dst)
    tokens = list(range(12))
    writer.save(StepPlan(saves=[transfer(tokens, [0, 1, 2])]))
    writer.flush()
    before = {name: t.clone() for name, t in dst.items()}
    real_get = store.batch_get

    def second_block_lost(namespace, keys, token_ids, **kw):
        results = real_get(namespace, keys, token_ids, **kw)
        results[1] = Miss(keys[1], MISS_NOT_FOUND)
        return results

    store.batch_get = second_block_lost  # type: ignore[method-assign]
    reader.load(StepPlan(loads=[transfer(tokens, [3, 4, 5])]))
    forward(reader)
    assert reader.load_errors() == {4, 5}
    assert reader.load_errors() == set()  # reported once
    # vLLM's statistics (get_kv_connector_stats): what moved, what vLLM recomputes.
    payload = ns("").payload_nbytes
    assert writer.tally.take() == {"saved_blocks": 3, "saved_bytes": 3 * payload}
    figures = reader.tally.take()
    assert figures.pop("fetch_seconds") > 0
    assert figures == {"loaded_blocks": 1, "loaded_bytes": payload, "load_failed_blocks": 2}
    for name in dst:
        assert torch.equal(dst[name][3], src[name][0])
        assert torch.equal(dst[name][4], before[name][4])
        assert torch.equal(dst[name][5], before[name][5])


def published(store: LocalStore, tokens: list[int]) -> dict[str, torch.Tensor]:
    src = caches()
    writer = WorkerSide(store, ns, H, D)
    writer.register(src)
    writer.save(StepPlan(saves=[transfer(tokens, list(range(len(tokens) // BS)))]))
    writer.close()
    return src


def test_an_asynchronous_load_is_reported_once_it_is_in() -> None:
    store = LocalStore()
    tokens = list(range(8))
    src, dst = published(store, tokens), caches()
    reader = WorkerSide(store, ns, H, D)
    reader.register(dst)
    reader.load(StepPlan(loads=[transfer(tokens, [2, 3], rid="late", asynchronous=True)]))
    done: set[str] = set()
    for _ in range(1000):
        done |= reader.finished_receiving()
        if done:
            break
        threading.Event().wait(0.01)
    assert done == {"late"} and reader.load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][2], src[name][0]) and torch.equal(dst[name][3], src[name][1])
    assert reader.finished_receiving() == set()  # reported once
    reader.close()


def test_a_forward_that_skips_a_layers_wait_turns_the_step_into_load_errors() -> None:
    """If vLLM ever read a layer without waiting for it, that KV may be half written: its
    blocks are reported for recompute and later loads are written before the forward."""
    store = LocalStore()
    tokens = list(range(8))
    src, dst = published(store, tokens), caches()
    reader = WorkerSide(store, ns, H, D, layerwise=True)
    reader.register(dst)
    reader.load(StepPlan(loads=[transfer(tokens, [0, 1])]))
    forward(reader, layers=L - 1)
    assert reader.load_errors() == {0, 1} and not reader.layerwise
    reader.load(StepPlan(loads=[transfer(tokens, [4, 5])]))  # written whole, now
    for name in src:
        assert torch.equal(dst[name][4], src[name][0]) and torch.equal(dst[name][5], src[name][1])
    forward(reader)
    assert reader.load_errors() == set()
    reader.close()


def test_vllm_is_told_to_recompute_what_kvstore_cannot_load() -> None:
    import pytest

    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvstore.integrations.vllm.connector import recompute_load_failures

    default = SimpleNamespace(kv_load_failure_policy="fail")  # vLLM's default: fail the request
    recompute_load_failures(default, {})
    assert default.kv_load_failure_policy == "recompute"
    kept = SimpleNamespace(kv_load_failure_policy="fail")
    recompute_load_failures(kept, {"fail_on_load_error": True})
    assert kept.kv_load_failure_policy == "fail"


def test_on_a_cpu_loads_read_on_the_calling_thread_into_a_buffer_touched_at_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU caches: the process's reads run on the calling thread (``cap_threads``), and the
    synchronous loads' buffer exists before the first request, and grows twice over."""
    from kvstore.block import block_nbytes
    from kvstore.client import verify_pool
    from kvstore.integrations.vllm import worker_side

    monkeypatch.setattr(verify_pool, "_cap", None)  # restored after: the cap is process-wide
    reader = WorkerSide(LocalStore(), ns, H, D)
    reader.register(caches())
    nbytes = block_nbytes(ns(""))
    assert verify_pool.num_threads() == 1
    assert reader._buffer is not None
    assert tuple(reader._buffer.shape) == (worker_side.PRELOAD_ROWS, nbytes)
    assert tuple(reader._rows(100, nbytes, shared=True).shape) == (128, nbytes)
    reader.close()


def held(store: LocalStore, tokens: list[int]) -> int:
    keys = [bytes(k) for k in BlockHasher(ns("")).block_keys(tokens)]
    return store.lookup_prefix(ns(""), keys).num_blocks


def test_a_cpu_save_is_gathered_at_the_next_step_before_vllm_reuses_its_blocks() -> None:
    """On a CPU ``save`` gathers nothing (the step's output goes first); ``before_step``
    (vLLM's handle_preemptions) gathers it before the next step may overwrite the blocks, so
    what is put is the KV the forward computed, not what came after."""
    store = LocalStore()
    src = caches()
    writer = WorkerSide(store, ns, H, D)
    writer.register(src)
    original = {name: t.clone() for name, t in src.items()}
    tokens = list(range(8))
    writer.save(StepPlan(saves=[transfer(tokens, [4, 1])]))
    writer.before_step()
    for t in src.values():  # the next step reuses both blocks
        t[4].zero_()
        t[1].fill_(7.0)
    writer.flush()
    assert writer.saved_blocks == 2
    dst = caches()
    reader = WorkerSide(store, ns, H, D)
    reader.register(dst)
    reader.load(StepPlan(loads=[transfer(tokens, [0, 5])]))
    forward(reader)
    for name in src:
        assert torch.equal(dst[name][0], original[name][4])
        assert torch.equal(dst[name][5], original[name][1])
    writer.close()
    reader.close()


def test_an_idle_engine_has_its_saves_gathered_and_put_without_another_step() -> None:
    store = LocalStore()
    writer = WorkerSide(store, ns, H, D)
    writer.register(caches())
    tokens = list(range(8))
    writer.save(StepPlan(saves=[transfer(tokens, [2, 3])]))
    for _ in range(500):  # the save thread's own deferral ends; no before_step, no flush
        if writer.saved_blocks == 2:
            break
        threading.Event().wait(0.01)
    assert writer.saved_blocks == 2 and held(store, tokens) == 2
    writer.close()


def test_a_step_that_began_without_before_step_drops_waiting_saves_and_gathers_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM that never calls handle_preemptions may have overwritten the blocks of a save
    that waits: it is dropped (never put with another request's KV), and later saves are
    gathered in ``save`` itself."""
    store = LocalStore()
    src = caches()
    writer = WorkerSide(store, ns, H, D)
    writer.register(src)
    writer._step_began.wait = lambda timeout=None: True  # type: ignore[method-assign]
    gate = threading.Event()
    writer._puts.submit(gate.wait)  # the save thread is busy: the save below waits
    first, second = list(range(8)), list(range(100, 108))
    writer.save(StepPlan(saves=[transfer(first, [0, 1])]))
    writer.load(StepPlan())  # the next step, with no before_step first
    assert not writer.defer_gathers and "without handle_preemptions" in caplog.text
    writer.save(StepPlan(saves=[transfer(second, [2, 3], rid="s")]))
    for t in src.values():
        t.zero_()  # overwritten after the second save: it was gathered already
    gate.set()
    writer.flush()
    assert held(store, first) == 0 and writer.saved_blocks == 2
    dst = caches()
    reader = WorkerSide(store, ns, H, D)
    reader.register(dst)
    reader.load(StepPlan(loads=[transfer(second, [4, 5])]))
    forward(reader)
    assert reader.load_errors() == set()
    assert all(dst[name][4].abs().sum() > 0 for name in dst)  # not the zeros written after
    writer.close()
    reader.close()


def test_each_transfer_is_saved_and_loaded_under_its_own_weights_version() -> None:
    """After vLLM reset the cache (weights updated in place) the plans name the new version:
    the worker saves there, and a load under the old version finds none of it."""
    store = LocalStore()
    src, dst = caches(), caches()
    writer, reader = registered_pair(store, ns, src, dst)
    tokens = list(range(8))
    writer.save(StepPlan(saves=[transfer(tokens, [4, 1], weights="v2")]))
    writer.flush()
    assert store.lookup_prefix(ns("", "v2"), transfer(tokens, [], weights="v2").keys
                               ).num_blocks == 2
    before = {name: t.clone() for name, t in dst.items()}
    reader.load(StepPlan(loads=[transfer(tokens, [0, 5])]))  # the old version's keys
    forward(reader)
    assert reader.load_errors() == {0, 5}
    assert all(torch.equal(dst[name], before[name]) for name in dst)  # nothing written
    reader.load(StepPlan(loads=[transfer(tokens, [0, 5], weights="v2")]))
    assert_loaded_blocks_4_1_into_0_5(reader, src, dst)
    writer.close()
    reader.close()
