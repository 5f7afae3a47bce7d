"""A real-style checkpoint directory (its own tokenizer, chat template, generation_config)
through the jobs, checked against plain ``transformers``: tokenization, chat rendering, where
generation stops, and the cache layouts the adapter refuses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvstore.cli.main import main
from kvstore.config_loader import load_config
from kvstore.errors import ConfigError
from kvstore.workers.jobs.prompts import parse_prompt_line, read_prompts
from kvstore.workers.model.causal_lm import generation_stop_ids, load_model
from kvstore.workers.model.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_for
from tests.support.checkpoint import build_checkpoint
from tests.support.cli_jobs import run, write_prompts

SYSTEM = ("You are a helpful assistant. Answer briefly and clearly. The store keeps the key and "
          "value tensors of every prompt block so that a second request starts from the cache.")
CHATS = [
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Tell me a short story about a robot."}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "How does a cache work?"}],
]
TEXT = "Hello there! What is the weather like in the city? café 🤖"
MAX_NEW = 10
FLAGS = ["--in-process", "--block-size", "16", "--chunk-tokens", "32",
         "--max-new-tokens", str(MAX_NEW), "--json"]


def hf_ids(tok, messages) -> list[int]:
    """``apply_chat_template`` token ids (transformers 5 returns a BatchEncoding by default)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_greedy(model, ids: list[int], eos: int | None) -> list[int]:
    """Plain transformers greedy decoding: the reference for where generation stops."""
    model.generation_config.eos_token_id = None  # only the eos given here, or none
    # An explicit mask: with a pad id equal to <s> (0), generate would mask the prompt's <s>.
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The checkpoint as built: generation_config's eos is ``</s>``."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "base")


@pytest.fixture(scope="module")
def hf_model(base):
    return AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def eos_case(base, hf_model, tmp_path_factory) -> tuple[Path, int, int]:
    """``(dir, eos, n)``: the same weights with a generation_config eos that greedy decoding of
    the first chat emits as its ``n``-th token (n > 1 and < MAX_NEW), so stopping is visible."""
    ids = hf_ids(AutoTokenizer.from_pretrained(base), CHATS[0])
    free = hf_greedy(hf_model, ids, None)
    n = next(i for i in range(2, MAX_NEW) if free[i - 1] not in free[:i - 1])
    eos = free[n - 1]
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt") / "eos", eos_token_id=eos)
    return path, eos, n




def test_text_is_tokenized_by_the_model_dirs_own_tokenizer(base, tmp_path):
    ref = AutoTokenizer.from_pretrained(base)
    tok = tokenizer_for(str(base), None)
    assert isinstance(tok, HFTokenizer)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "t", "text": TEXT}])
    assert read_prompts(prompts, tok) == [("t", ref.encode(TEXT))]
    assert ref.encode(TEXT) != ByteTokenizer().encode(TEXT)  # not bytes by another name
    # An explicit --tokenizer still wins; a preset still gets bytes.
    assert isinstance(tokenizer_for("tiny", None), ByteTokenizer)
    assert isinstance(tokenizer_for("tiny", str(base)), HFTokenizer)


def test_messages_render_as_the_checkpoints_chat_template(base):
    ref = AutoTokenizer.from_pretrained(base)
    tok = tokenizer_for(str(base), None)
    for chat in CHATS:
        assert parse_prompt_line({"id": 7, "messages": chat}, tok, "p.jsonl:1") == (
            "7", hf_ids(ref, chat))
    assert parse_prompt_line({"messages": CHATS[0]}, tok, "x")[0] is None


def test_presets_render_messages_with_the_builtin_template():
    _, ids = parse_prompt_line({"messages": CHATS[1]}, ByteTokenizer(), "p.jsonl:1")
    assert bytes(ids).decode() == (f"<|system|>\n{SYSTEM}\n<|user|>\nHow does a cache work?\n"
                                   "<|assistant|>\n")


@pytest.mark.parametrize("obj, match", [
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": ["hi"]}, r"'messages'\[0\] must be an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "'role' must be one of system, user"),
    ({"messages": [{"role": "user"}]}, "'content' must be a string"),
    ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "unknown keys"),
    ({"messages": [{"role": "user", "content": "x"}], "text": "x"}, "exactly one of"),
])
def test_bad_messages_name_the_line_and_the_fault(base, obj, match):
    with pytest.raises(ConfigError, match=match) as info:
        parse_prompt_line(obj, tokenizer_for(str(base), None), "p.jsonl:3")
    assert str(info.value).startswith("p.jsonl:3: ")


def test_a_tokenizer_without_a_chat_template_refuses_messages(tmp_path):
    path = build_checkpoint(tmp_path / "plain", chat_template=False)
    with pytest.raises(ConfigError, match="p.jsonl:1: .*has no chat template"):
        parse_prompt_line({"messages": CHATS[0]}, tokenizer_for(str(path), None), "p.jsonl:1")


def test_a_model_dir_without_tokenizer_files_is_refused(base, tmp_path, capsys):
    path = build_checkpoint(tmp_path / "weights", with_tokenizer=False)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "t", "text": TEXT}])
    assert main(["generate", "--prompts", prompts, "--model", str(path), *FLAGS]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="pass --tokenizer DIR"):
        tokenizer_for(str(path), None)
    assert isinstance(tokenizer_for(str(path), str(base)), HFTokenizer)


def test_stop_ids_come_from_generation_config_then_config(base, tmp_path):
    assert generation_stop_ids("tiny") == ()
    assert generation_stop_ids(str(base)) == (1,)  # </s>
    both = build_checkpoint(tmp_path / "both", eos_token_id=7)
    (both / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert generation_stop_ids(str(both)) == (7, 9)
    (both / "generation_config.json").unlink()
    assert generation_stop_ids(str(both)) == (1,)  # config.json's


@pytest.mark.parametrize("extra, want", [([], (5, 1)), (["--ignore-eos"], (5,))])
def test_sampling_stops_at_the_union_unless_eos_is_ignored(base, extra, want):
    from kvstore.cli.main import build_parser
    from kvstore.workers.jobs.commands import make_sampling

    args = build_parser().parse_args(["generate", "--prompts", "p.jsonl", "--model", str(base),
                                      "--stop-token-ids", "5", *extra])
    assert isinstance(args, argparse.Namespace)
    config = load_config(None, overrides={"worker": {"model": str(base)}})
    assert make_sampling(args, config).stop_token_ids == want


def test_generation_stops_where_transformers_stops(eos_case, hf_model, tmp_path, capsys):
    path, eos, n = eos_case
    ref_tok = AutoTokenizer.from_pretrained(path)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"c{i}", "messages": chat}
                                                   for i, chat in enumerate(CHATS)])
    argv = ["generate", "--prompts", prompts, "--model", str(path), *FLAGS]
    rc, cached = run(capsys, *argv)
    assert rc == 0
    rc, nocache = run(capsys, *argv, "--no-cache")
    assert rc == 0
    want = [hf_greedy(hf_model, hf_ids(ref_tok, chat), eos) for chat in CHATS]
    assert [r["output_token_ids"] for r in cached] == want
    assert [r["output_token_ids"] for r in nocache] == want
    assert len(want[0]) == n < MAX_NEW and want[0][-1] == eos
    assert cached[1]["cached_tokens"] >= 32  # the shared system prompt came from the store
    assert [r["text"] for r in cached] == [ref_tok.decode(w, skip_special_tokens=True)
                                           for w in want]
    rc, ignored = run(capsys, *argv, "--ignore-eos")
    assert rc == 0
    want = [hf_greedy(hf_model, hf_ids(ref_tok, chat), None) for chat in CHATS]
    assert [r["output_token_ids"] for r in ignored] == want
    assert all(len(w) == MAX_NEW for w in want)


def test_text_prompts_generate_as_transformers_does(base, hf_model, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "t", "text": TEXT}])
    rc, rows = run(capsys, "generate", "--prompts", prompts, "--model", str(base), *FLAGS,
                   "--ignore-eos")
    assert rc == 0
    ids = AutoTokenizer.from_pretrained(base).encode(TEXT)
    assert rows[0]["output_token_ids"] == hf_greedy(hf_model, ids, None)


@pytest.mark.parametrize("overrides, match", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"sliding_window": 8}, "sliding-window"),
])
def test_sliding_attention_is_refused_at_load(tmp_path, overrides, match):
    path = build_checkpoint(tmp_path / "sw", config_overrides=overrides)
    with pytest.raises(ConfigError, match=match):
        load_model(str(path))
