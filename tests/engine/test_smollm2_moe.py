"""smollm2-moe: the MoE derived from SmolLM2 (deepinfer/loading/derive_moe.py), written as a Mixtral directory.

The default directory (DEFAULT_NUM_EXPERTS experts, top DEFAULT_TOP_K) is built once per module through the
CLI into a private cache; the other tests read it. Derivations in this module: that one, an 8-expert top-8 one
(equal to the dense model), and the user cache's default directory if it is not there yet (the mesh tests on
smollm2-moe read it too): the determinism test compares the two default directories byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from deepinfer.launch.cli import main as cli
from deepinfer.loading import derive_moe as dm
from deepinfer.loading.fetch import SMOLLM2_FILE, SMOLLM2_NAME, fetch_smollm2_moe, smollm2_moe_dir
from deepinfer.loading.moe_report import expert_load
from deepinfer.text.tokenizer import Tokenizer
from tests.engine.oracle import hf_logits

PROMPT = "The lighthouse keeper wrote in his ledger that the storm had lasted eleven days, and"


def _sha256(path) -> str:  # type: ignore[no-untyped-def]
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----- no model needed -----


def test_partition_is_balanced_complete_and_seeded():
    gate = np.random.default_rng(7).standard_normal((96, 16)).astype(np.float32)
    parts = dm.partition_neurons(gate, 8, seed=0)
    assert parts.shape == (8, 12)
    assert sorted(parts.reshape(-1).tolist()) == list(range(96))
    assert np.array_equal(parts, dm.partition_neurons(gate, 8, seed=0))
    with pytest.raises(ValueError, match="not divisible"):
        dm.partition_neurons(gate, 7)


def test_partition_groups_neurons_with_similar_gates():
    # Four well-separated gate directions, 8 neurons each, shuffled: each expert gets exactly one direction.
    rng = np.random.default_rng(3)
    centres = np.eye(4, 16) * 10
    gate = np.repeat(centres, 8, axis=0) + rng.standard_normal((32, 16)) * 0.1
    order = rng.permutation(32)
    parts = dm.partition_neurons(gate[order], 4)
    family = (order // 8)[parts]
    assert all(len(set(row)) == 1 for row in family.tolist())


# ----- on SmolLM2's weights (marked smollm2) -----


@pytest.fixture(scope="module")
def cache(tmp_path_factory, smollm2_path):
    """A private cache directory holding (a link to) the fetched SmolLM2 GGUF."""
    root = tmp_path_factory.mktemp("moe-cache")
    (root / SMOLLM2_NAME).mkdir()
    os.symlink(smollm2_path, root / SMOLLM2_NAME / SMOLLM2_FILE)
    return root


def _fetch(cache, *args: str):  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(cli, ["fetch", "smollm2-moe", "--cache-dir", str(cache), *args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def moe_dir(cache):
    result = _fetch(cache)
    path = smollm2_moe_dir(dm.DEFAULT_NUM_EXPERTS, dm.DEFAULT_TOP_K, cache)
    assert result.stdout.strip().splitlines()[-1] == str(path)
    return path


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()



@pytest.mark.smollm2
def test_fetch_twice_reuses_the_directory(cache, moe_dir):
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in moe_dir.iterdir()}
    result = _fetch(cache)  # no derivation: the same files, untouched (inode and mtime below)
    assert result.stdout.strip().splitlines()[-1] == str(moe_dir)
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in moe_dir.iterdir()} == before
    assert [p.name for p in moe_dir.parent.iterdir() if p.name.startswith(".derive-")] == []  # no leftovers
    assert moe_dir.name == f"smollm2-moe-e{dm.DEFAULT_NUM_EXPERTS}-k{dm.DEFAULT_TOP_K}"


@pytest.mark.smollm2
def test_fetch_report_prints_perplexities_and_the_per_layer_histogram(cache, moe_dir):
    lines = _fetch(cache, "--report").stdout.strip().splitlines()
    assert lines[-1] == str(moe_dir)  # the path is still the last line, for scripts
    text = "\n".join(lines)
    dense, derived = (float(x) for x in re.search(r"perplexity: dense ([\d.]+)  derived MoE ([\d.]+)", text).groups())
    assert dense == pytest.approx(14.13, abs=0.01)  # the README's figure for dense SmolLM2 on the fixed text
    assert dense < derived < 100
    tokens = int(re.search(r"fixed text: (\d+) tokens", text).group(1))
    rows = [line for line in lines if line.lstrip().startswith("layer ")]
    assert len(rows) == 30
    for row in rows:
        counts = [int(n) for n in row.split(":")[1].split("max/mean")[0].split()]
        assert len(counts) == dm.DEFAULT_NUM_EXPERTS
        assert sum(counts) == tokens * dm.DEFAULT_TOP_K  # every token chose exactly k experts


@pytest.mark.smollm2
def test_fetch_refuses_bad_shapes(cache):
    for args, message in [(["--experts", "7"], "divide"), (["--experts", "8", "--top-k", "9"], "top-k")]:
        result = CliRunner().invoke(cli, ["fetch", "smollm2-moe", "--cache-dir", str(cache), *args])
        assert result.exit_code != 0 and message in result.output
    result = CliRunner().invoke(cli, ["fetch", "smollm2", "--top-k", "2"])
    assert result.exit_code != 0 and "smollm2-moe only" in result.output


@pytest.mark.smollm2
def test_derivation_is_deterministic(moe_dir):
    """This run's derivation into the private cache = the user cache's, derived by another fetch (in this run,
    on a fresh machine, or in an earlier one: then a change to what the derivation writes that kept
    DERIVE_METHOD fails here, since a stale cached directory would otherwise be served)."""
    shared = fetch_smollm2_moe(progress=False)
    assert shared != moe_dir
    names = sorted(f.name for f in moe_dir.iterdir())
    assert names == sorted(f.name for f in shared.iterdir())
    assert {n: _sha256(moe_dir / n) for n in names} == {n: _sha256(shared / n) for n in names}


@pytest.mark.smollm2
def test_directory_is_a_documented_mixtral_with_the_same_tokenizer(smollm2_path, moe_dir):
    from transformers import AutoTokenizer

    config = json.loads((moe_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    e, k = dm.DEFAULT_NUM_EXPERTS, dm.DEFAULT_TOP_K
    shape = (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"])
    assert shape == (e, k, 1536 // e)
    assert config["deepinfer_derived"]["trained"] is False
    assert "derived, not trained" in (moe_dir / "README.md").read_text()
    partition = json.loads((moe_dir / "derivation.json").read_text())["experts"]
    assert all(sorted(sum(layer, [])) == list(range(1536)) for layer in partition)

    text = dm.EVAL_TEXT.read_text()[:2000]
    ours = Tokenizer.from_gguf(smollm2_path)
    assert Tokenizer.from_dir(moe_dir).encode(text) == ours.encode(text)
    assert AutoTokenizer.from_pretrained(moe_dir)(text)["input_ids"] == ours.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert Tokenizer.from_dir(moe_dir).encode_chat(chat) == ours.encode_chat(chat)


@pytest.mark.smollm2
def test_transformers_runs_it_as_our_forward_does(smollm2_path, moe_dir, hf_moe):
    """transformers' MixtralForCausalLM on the directory = the module's own forward (which the load histogram
    and the report use): same logits, same experts chosen at every layer, and it generates."""
    ids = Tokenizer.from_gguf(smollm2_path).encode(PROMPT)
    moe = dm.load_moe_dir(moe_dir)
    ours, routes = dm.forward(moe.config, moe.base, ids, moe)
    with torch.inference_mode():
        out = hf_moe(torch.tensor([ids]), output_router_logits=True)
    assert (out.logits[0] - ours).abs().max().item() < 1e-3
    for layer, (logits, chosen) in enumerate(zip(out.router_logits, routes)):
        theirs = torch.softmax(logits.float(), dim=-1).topk(moe.top_k, dim=-1).indices
        assert torch.equal(theirs.sort(-1).values, chosen.sort(-1).values), f"layer {layer} routes differently"
    with torch.inference_mode():
        generated = hf_moe.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, len(ids) + 8)
    assert generated[0, len(ids)].item() == ours[-1].argmax().item()


@pytest.mark.smollm2
def test_top_k_equal_to_experts_is_the_dense_model(smollm2_path, smollm2_oracle, tmp_path):
    from transformers import MixtralForCausalLM

    path = tmp_path / "e8-k8"
    dm.write_moe_dir(smollm2_path, path, num_experts=8, top_k=8)
    ids = Tokenizer.from_gguf(smollm2_path).encode(PROMPT)
    with torch.inference_mode():
        moe_logits = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits
    dense_logits = hf_logits(smollm2_oracle.hf, ids)[None]
    # Every neuron kept, each expert's weight exactly 1/8 and its down projection x8: only summation order differs.
    assert (moe_logits - dense_logits).abs().max().item() < 1e-3
    assert torch.equal(moe_logits.argmax(-1), dense_logits.argmax(-1))


@pytest.mark.smollm2
def test_real_text_routes_unevenly(smollm2_path, moe_dir):
    ids = Tokenizer.from_gguf(smollm2_path).encode(dm.EVAL_TEXT.read_text())
    moe = dm.load_moe_dir(moe_dir)
    _, routes = dm.forward(moe.config, moe.base, ids, moe)
    load = expert_load(routes, moe.num_experts)
    assert load.shape == (30, moe.num_experts) and (load.sum(axis=1) == len(ids) * moe.top_k).all()
    skew = load.max(axis=1) / load.mean(axis=1)
    low = load.min(axis=1) / load.mean(axis=1)
    # Even routing would give 1.0 for both. Measured with the defaults (16 experts, top-12, 930 tokens): max/mean
    # worst layer 1.333 (the ceiling 16/12: an expert every token chose), mean over layers 1.302; min/mean lowest
    # layer 0.229, mean over layers 0.657.
    assert skew.max() > 1.25 and skew.mean() > 1.2, skew
    assert low.min() < 0.5 and low.mean() < 0.8, low
