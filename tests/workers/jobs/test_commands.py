"""The worker subcommands through the real ``kvstore`` parser, in-process (no Ray)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvstore.cli.main import main
from tests.support.cli_jobs import run, write_prompts

FLAGS = ["--in-process", "--model", "tiny", "--block-size", "16", "--chunk-tokens", "32",
         "--max-new-tokens", "4", "--json"]


def make_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()




def test_generate_cached_equals_no_cache(tmp_path, capsys):
    system = make_prompt(64, seed=1)
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"id": f"q{i}", "token_ids": system + make_prompt(10 + i, seed=5 + i)} for i in range(3)
    ] + [{"id": "text", "text": "hello kvstore"}])
    rc, cached = run(capsys, "generate", "--prompts", prompts, "--prefill-replicas", "2",
                     *FLAGS, "--output", str(tmp_path / "out.jsonl"))
    assert rc == 0
    rc, ref = run(capsys, "generate", "--prompts", prompts, "--no-cache", *FLAGS)
    assert rc == 0
    assert [r["output_token_ids"] for r in cached] == [r["output_token_ids"] for r in ref]
    assert [r["cached_tokens"] for r in cached] == [0, 64, 64, 0]
    assert all(len(r["output_token_ids"]) == 4 and "sources" in r and "ttft_s" in r
               for r in cached)
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4


def test_prefill_then_decode_jobs(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl",
                            [{"id": "a", "token_ids": make_prompt(70, seed=3)}])
    rc, pre = run(capsys, "prefill", "--prompts", prompts, *FLAGS)
    assert rc == 0 and len(pre[0]["output_token_ids"]) == 1
    rc, dec = run(capsys, "decode", "--prompts", prompts, *FLAGS)
    assert rc == 0 and len(dec[0]["output_token_ids"]) == 4


def test_demo_json_in_process(capsys):
    rc, rows = run(capsys, "demo", *FLAGS, "--system-tokens", "96", "--requests", "2",
                   "--suffix-tokens", "10")
    assert rc == 0
    (fig,) = rows
    assert fig["outputs_match"] is True and fig["hit_rate"] > 0.8 and fig["bytes_fetched"] > 0
    assert fig["cold_ttft_s"] > 0 and fig["warm_ttft_s"] > 0
    assert fig["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("line, match", [
    ("not json", "not JSON"),
    ('{"id": 1}', "exactly one of"),
    ('{"id": 1, "token_ids": ["a"]}', "list of ints"),
    ('{"id": 1, "token_ids": [999999]}', "vocabulary"),
    ('{"id": 1, "messages": [{"role": "bot", "content": "x"}]}', "bad.jsonl:1: 'messages'[0]"),
])
def test_bad_prompt_files_exit_2_with_a_message(tmp_path, capsys, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    assert main(["generate", "--prompts", str(path), *FLAGS]) == 2
    assert match in capsys.readouterr().err


def test_a_preset_takes_messages_in_its_builtin_template(tmp_path, capsys):
    chat = [{"role": "user", "content": "hello kvstore"}]
    rendered = list(b"<|user|>\nhello kvstore\n<|assistant|>\n")
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "m", "messages": chat},
                                                   {"id": "t", "token_ids": rendered}])
    rc, rows = run(capsys, "generate", "--prompts", prompts, "--no-cache", *FLAGS)
    assert rc == 0
    assert rows[0]["output_token_ids"] == rows[1]["output_token_ids"]
    assert "text" not in rows[0]  # bytes of random weights: no text


@pytest.mark.parametrize("spec, want", [("prefill", {"prefill": 0.01}),
                                        ("decode=0.5", {"decode": 0.5})])
def test_placement_resource_specs(spec, want):
    from kvstore.workers.jobs.deployment import parse_resource

    assert parse_resource(spec) == want


@pytest.mark.parametrize("argv, match", [
    (["--prefill-resource", "prefill"], "drop --in-process"),
    (["--decode-resource", "decode=x"], "AMOUNT must be a number"),
    (["--decode-resource", "CPU"], "custom Ray resource"),
    (["--prefill-resource", "prefill=0"], "AMOUNT must be > 0"),
])
def test_bad_placement_exits_2_with_a_message(tmp_path, capsys, argv, match):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "token_ids": [1, 2, 3]}])
    assert main(["generate", "--prompts", prompts, *FLAGS, *argv]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "prefill", "decode"])
def test_zero_new_tokens_returns_no_tokens(tmp_path, capsys, command):
    prompts = write_prompts(tmp_path / "p.jsonl",
                            [{"id": f"q{i}", "token_ids": make_prompt(40 + i, seed=i)}
                             for i in range(2)])
    flags = [f for f in FLAGS if f != "4"]
    flags[flags.index("--max-new-tokens") + 1:] = ["0", "--json"]
    rc, rows = run(capsys, command, "--prompts", prompts, *flags)
    assert rc == 0
    assert [r["output_token_ids"] for r in rows] == [[], []]


def test_output_to_a_missing_directory_fails_before_any_work(tmp_path, capsys, monkeypatch):
    import kvstore.workers.jobs.commands

    def no_deployment(*args, **kwargs):
        raise AssertionError("the deployment started before --output was checked")

    monkeypatch.setattr(kvstore.workers.jobs.commands, "Deployment", no_deployment)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "token_ids": [1, 2, 3]}])
    out = tmp_path / "missing" / "out.jsonl"
    assert main(["generate", "--prompts", prompts, *FLAGS, "--output", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--prompts", prompts, *FLAGS, "--output", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_output_check_in_a_subprocess(tmp_path):
    import subprocess
    import sys

    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "token_ids": [1, 2, 3]}])
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "generate", "--in-process",
                           "--model", "tiny", "--prompts", prompts,
                           "--output", str(tmp_path / "nope" / "out.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kvstore: error: --output {tmp_path / 'nope' / 'out.jsonl'}: directory "
        f"{tmp_path / 'nope'} does not exist"]


def test_a_failed_write_keeps_the_results(tmp_path):
    from kvstore.errors import ConfigError
    from kvstore.workers.jobs.commands import write_output

    rows = [{"id": "a", "output_token_ids": [1, 2]}]
    with pytest.raises(ConfigError, match="the results are in") as info:
        write_output(str(tmp_path), rows)  # a directory: the write fails
    rescue = str(info.value).rsplit(" ", 1)[-1]
    try:
        assert [json.loads(line) for line in open(rescue)] == rows
    finally:
        import os

        os.unlink(rescue)


def test_json_stdout_is_exactly_json_and_the_phases_go_to_stderr(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl",
                            [{"id": f"q{i}", "token_ids": make_prompt(20, seed=i)}
                             for i in range(3)])
    assert main(["generate", "--prompts", prompts, *FLAGS]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]  # every line, unfiltered
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"]
    phases = [line for line in err.splitlines() if line.startswith("kvstore: ")]
    assert phases[0].startswith("kvstore: loading 1 prefill and 1 decode replicas of model "
                                "tiny in this process: ")
    assert phases[-1].startswith("kvstore: generate: 3/3 requests (")


def test_demo_piped_prints_one_json_object_and_its_phases_in_order(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "demo", *FLAGS,
                           "--system-tokens", "64", "--requests", "2", "--suffix-tokens", "8"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout)  # the whole of stdout: one object, nothing else
    assert figures["outputs_match"] is True
    labels = [line.removeprefix("kvstore: ").rsplit(": ", 1)[0]
              for line in proc.stderr.splitlines() if line.startswith("kvstore: ")]
    assert [label.split(" ")[0] for label in labels] == [
        "loading", "cold", "warm", "warm", "--no-cache", "--no-cache", "--no-cache"]
    assert "\x1b" not in proc.stderr and "Warning" not in proc.stderr


def test_demo_on_a_terminal_shows_each_phase_done(capsys, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    flags = [f for f in FLAGS if f != "--json"]
    assert main(["demo", *flags, "--system-tokens", "64", "--requests", "2",
                 "--suffix-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err)  # the terminal's colours and cursor
    for phase in ("✓ loading 2 prefill and 1 decode replicas of model tiny",
                  "✓ cold request: prefilling the 64-token system prompt",
                  "✓ warm requests (the system prompt from the store): 2 requests",
                  "✓ --no-cache reference runs: 3 requests"):
        assert phase in err
    assert "cold TTFT" in out and "✓" not in out
