"""deepinfer-launch as a user runs it: a real process on the real model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smollm2


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_fetch_prints_the_path_last(smollm2_path):
    out = launch("fetch", "smollm2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(smollm2_path)


def test_generate_json_from_prompts_file_in_input_order(smollm2_path, tmp_path):
    prompts = ["What is the capital of France?", "Count from one to five.", "Say hello in German."]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    out = launch("generate", "--model", str(smollm2_path), "--prompts-file", str(f), "--chat", "--json",
                 "--max-tokens", "16", "--threads", "2")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert set(line) >= {"text", "token_ids", "finish_reason", "usage"}
        assert line["finish_reason"] in ("stop", "length")
        assert line["usage"]["completion_tokens"] == len(line["token_ids"]) > 0
        # The chat template's shared system preamble may hit the prefix cache if one prompt's prefill ends before
        # another's is placed (timing); the question itself never can: each line is a different one.
        assert 0 <= line["usage"]["cached_tokens"] < line["usage"]["prompt_tokens"]
        assert line["usage"]["spec_proposed_tokens"] == line["usage"]["spec_accepted_tokens"] == 0  # not asked for
    assert "Paris" in lines[0]["text"]
    # Same prompt alone, speculating: same greedy answer (neither batching nor speculation changes results).
    alone = launch("generate", "--model", "smollm2", "--prompt", prompts[0], "--chat", "--json",
                   "--max-tokens", "16", "--threads", "2", "--speculative", "ngram", "--num-speculative-tokens", "3")
    assert alone.returncode == 0, alone.stderr
    result = json.loads(alone.stdout.strip())
    assert result["token_ids"] == lines[0]["token_ids"]
    assert result["usage"]["spec_proposed_tokens"] >= result["usage"]["spec_accepted_tokens"] >= 0


def test_generate_with_a_json_schema_answers_valid_json(smollm2_path, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    out = launch("generate", "--model", str(smollm2_path), "--prompt", "What is the capital of France? Answer in JSON.",
                 "--chat", "--json", "--json-schema", str(f), "--max-tokens", "32", "--threads", "2")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip())
    assert result["finish_reason"] == "stop"
    jsonschema.validate(json.loads(result["text"]), schema)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    refused = launch("generate", "--model", str(smollm2_path), "--prompt", "x", "--json-schema", str(bad))
    assert refused.returncode != 0 and "not JSON" in refused.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "x " * 9000], "context"),
        ([], "--prompt"),
        (["--prompt", "hi", "--speculative", "foo"], "unknown speculative method 'foo'"),
        (["--prompt", "hi", "--speculative", "draft:"], "a draft model needs a path"),
    ],
)
def test_bad_input_is_a_clear_error(smollm2_path, args, message):
    out = launch("generate", "--model", str(smollm2_path), *args)
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_model_is_a_clear_error(tmp_path):
    out = launch("generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert out.returncode != 0 and "missing.gguf" in out.stderr and "Traceback" not in out.stderr
