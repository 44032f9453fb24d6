"""``hyjax generate`` as a user runs it (a real subprocess), and the ``hyjax.LLM`` API."""

import json
import re
import subprocess
import sys

import pytest

import hyjax
from hyjax.tiny import make_tiny_model

# One 64-token prefill bucket: the start-up compiles 4 step shapes, not every small bucket.
SMALL = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--max-model-len", "128"]
SMALL += ["--min-token-bucket", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)


def test_generate_cli(model_dir, tmp_path):
    rows = [
        {"prompt": "Hello there", "max_tokens": 5, "id": "a"},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0.7, "seed": 3},
        {"prompt": "x" * 300},  # over --max-model-len: a per-row error, the rest carry on
        {"prompt": "Hello there", "max_tokens": 5, "stop": ["\u0000"]},
        # Checked as the server checks a request, before the model loads; the field is named.
        {"prompt": "Hi", "max_tokens": "ten"},
        {"prompt": ["a", "b"]},
        {"prompt": "Hi", "stop": [""]},
        {"prompt": "Hi", "prompt_token_ids": [1]},
        {"prompt": "Hi", "cache_salt": ""},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        sys.executable,
        "-m",
        "serving.entrypoints.cli",
        "generate",
        "--model",
        model_dir,
        "--input",
        str(inp),
        "--output",
        str(out),
        *SMALL,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    # Rows that failed: exit 1 with a summary naming them; the good rows' output is written.
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "9 requests (6 rejected, 0 failed)" in proc.stdout
    assert "prefix-cache hit rate" in proc.stdout
    # The buckets compile as the batch meets them; that time is reported, not in the tok/s.
    compile_s = float(re.search(r"and ([0-9.]+) s compiling step shapes", proc.stdout)[1])
    assert compile_s > 0
    assert f"{inp} row 3: " in proc.stderr and f"{inp} row 8: " in proc.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 9
    for r_in, r_out in zip(rows, got):
        for k, v in r_in.items():
            assert r_out[k] == v  # input fields kept, in input order
    assert got[0]["num_prompt_tokens"] == len("Hello there")
    assert len(got[0]["output_token_ids"]) == 5 and got[0]["finish_reason"] == "length"
    assert isinstance(got[0]["text"], str) and got[0]["num_cached_tokens"] == 0
    assert len(got[1]["output_token_ids"]) == 3
    assert got[2]["finish_reason"] == "error" and "maximum context length" in got[2]["error"]
    assert got[4]["error"].startswith("max_tokens: ")
    assert got[5]["error"].startswith("prompt: ")
    assert got[6]["error"].startswith("stop=") and "empty" in got[6]["error"]
    assert "exactly one of prompt" in got[7]["error"]
    assert got[8]["error"].startswith("cache_salt: ")
    assert all(r["finish_reason"] == "error" for r in got[4:])
    assert got[3]["output_token_ids"][:5] == got[0]["output_token_ids"][:5] or (
        got[3]["finish_reason"] == "stop"
    )


def test_generate_cli_bad_input_file(model_dir, tmp_path):
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"prompt": "ok"}\n{not json\n')
    cmd = [
        sys.executable,
        "-m",
        "serving.entrypoints.cli",
        "generate",
        "--model",
        model_dir,
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "o.jsonl"),
        *SMALL,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "bad.jsonl:2: not valid JSON" in proc.stderr
    # A missing input file and a model directory that is not one: a message, no traceback.
    i = cmd.index("--input") + 1
    proc = subprocess.run(cmd[:i] + [str(tmp_path / "missing.jsonl")] + cmd[i + 1 :],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode != 0 and "missing.jsonl: No such file" in proc.stderr
    assert "Traceback" not in proc.stderr
    inp.write_text('{"prompt": "ok"}\n')
    m = cmd.index("--model") + 1
    proc = subprocess.run(cmd[:m] + [str(tmp_path / "nowhere")] + cmd[m + 1 :],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode != 0 and "cannot start the engine" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_llm_api(model_dir):
    llm = hyjax.LLM(
        model=model_dir, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
        min_token_bucket=64,
    )  # fmt: skip
    params = hyjax.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["The cat", "The cat sat"], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert outs[0].prompt == "The cat" and outs[0].outputs[0].finish_reason == "length"
    again = llm.generate("The cat", params)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="does not match"):
        llm.generate(["a", "b"], [params])


def test_every_flag_says_what_it_does():
    """``--help`` of each command documents every option (and argparse adds its default)."""
    from serving.entrypoints.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0]
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.dest != "help":
                assert action.help, f"hyjax {name} {action.option_strings or action.dest}"
        assert "(default: 32)" in parser.format_help() or name not in ("generate", "serve")


def test_speculative_config_flag_is_checked_at_parse_time(capsys):
    from serving.entrypoints.cli import build_parser

    argv = ["generate", "--prompt", "x", "--speculative-config"]
    for bad, msg in (("{", "not valid JSON"), ('{"method": "eagle", "num_speculative_tokens": 1}',
                     "not supported")):  # fmt: skip
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv + [bad])
        assert msg in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_flag_reaches_engine_args(command):
    """Each ``EngineArgs`` flag field is a flag of both commands, and its value arrives."""
    from serving.engine.engine_args import flag_fields
    from serving.entrypoints.cli import build_parser, engine_kwargs

    argv, want = [command] + (["--prompt", "x"] if command == "generate" else []), {}
    for f in flag_fields():
        flag = "--" + f.name.replace("_", "-")
        choices = f.metadata["argparse"].get("choices")
        if isinstance(f.default, bool) or f.type == "bool | None":
            value = not f.default
            argv.append(flag if value else "--no-" + flag[2:])  # False -> True: store_true
        else:
            value = choices[-1] if choices else ("/m" if f.name == "model" else 7)
            if f.name == "compilation_cache_dir":
                value = "/cache"
            if f.name == "speculative_config":
                value = '{"method": "ngram", "num_speculative_tokens": 2}'
            argv += [flag, str(value)]
        want[f.name] = value
    got = engine_kwargs(build_parser().parse_args(argv))
    assert {k: got[k] for k in want} == want
    assert len(want) >= 19
