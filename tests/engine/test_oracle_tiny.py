"""The engine against transformers on tiny random-weight models of each supported variant.

Greedy outputs of 32 tokens for 9 prompts of different lengths, submitted at different times, must
equal transformers' token for token (up to an oracle near-tie), with ample memory, with chunked
prefill forced by a small token budget, and with preemption forced by a tiny KV pool (victims swapped to host
memory and back, or recomputed).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import FinishReason, SamplingParams
from deepinfer.loading.weights import load_model_weights
from tests.engine.oracle import assert_same_greedy, hf_greedy

NEW_TOKENS = 32
VARIANTS = {
    # name: (transformers config class name, config kwargs)
    "llama-gqa-untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                             tie_word_embeddings=False)),
    "llama-mha-tied-llama3-rope": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=4, hidden_size=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-head-dim-24-linear-rope": ("LlamaConfig", dict(
        num_attention_heads=6, num_key_value_heads=2, hidden_size=96, head_dim=24, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-yarn-rope": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, hidden_size=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128})),
    "qwen2-bias-tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                            tie_word_embeddings=True)),
}
MODES = {
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=512),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=24),
    # 9 sequences of up to ~100 tokens in 40 blocks of 4: preemption is certain. Victims swap to host memory
    # where that is predicted cheaper (the default), or always recompute (no swap space).
    "preempt": dict(num_kv_blocks=40, max_num_batched_tokens=512),
    "preempt-recompute": dict(num_kv_blocks=40, max_num_batched_tokens=512, swap_space_bytes=0),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_model(request, tmp_path_factory):
    import transformers

    cls_name, kwargs = VARIANTS[request.param]
    torch.manual_seed(zlib.crc32(request.param.encode()))  # stable across runs (str hash() is salted per process)
    config = getattr(transformers, cls_name)(
        vocab_size=320, intermediate_size=112, num_hidden_layers=3, max_position_embeddings=512,
        rms_norm_eps=1e-5, **kwargs,
    )
    model_cls = transformers.LlamaForCausalLM if cls_name == "LlamaConfig" else transformers.Qwen2ForCausalLM
    hf = model_cls(config).eval()
    # Random init leaves biases at zero; make them count.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model_weights(path)


def prompts(seed: int = 0, n: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 33, 48, 64, 70][:n]
    return [[rng.randrange(320) for _ in range(k)] for k in lengths]


def run_staggered(engine: LLMEngine, batch: list[list[int]], classes: bool = False) -> dict[int, list[int]]:
    """Submit a third of the prompts, step, submit more while the first are mid-flight, run to the end.
    `classes`: each later third is of a higher priority class than the one before."""
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    pending = list(enumerate(batch))
    ids: dict[str, int] = {}
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            for _ in range(3):
                if pending:
                    i, p = pending.pop(0)
                    ids[engine.add_request(f"p{i}", p, params, priority=-(i // 3) if classes else 0)] = i
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH
                outputs[ids[out.request_id]] = out.token_ids
        steps += 1
    return outputs


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny_model, mode):
    hf, loaded = tiny_model
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, **MODES[mode]))
    start_free = engine.num_free_blocks
    batch = prompts()
    ours = run_staggered(engine, batch)
    for i, p in enumerate(batch):
        assert_same_greedy(hf, p, ours[i], hf_greedy(hf, p, NEW_TOKENS))
    assert engine.num_free_blocks == start_free
    engine.pool.check_integrity()
    if mode.startswith("preempt"):
        assert engine.stats.num_preemptions > 0
        swapped = engine.stats.num_swapped_preemptions
        assert swapped > 0 if mode == "preempt" else swapped == 0
        assert engine.stats.swap_in_blocks > 0 if mode == "preempt" else engine.swap_policy is None


def test_higher_classes_preempting_lower_ones_match_transformers(tiny_model):
    hf, loaded = tiny_model
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, **MODES["preempt"]))
    start_free = engine.num_free_blocks
    batch = prompts()
    ours = run_staggered(engine, batch, classes=True)  # the longest prompts come last, in the highest class
    for i, p in enumerate(batch):
        assert_same_greedy(hf, p, ours[i], hf_greedy(hf, p, NEW_TOKENS))
    assert engine.num_free_blocks == start_free and engine.stats.num_preemptions > 0
    engine.pool.check_integrity()


def test_a_victim_whose_swap_out_fails_recomputes_and_nothing_leaks(tiny_model, monkeypatch):
    """Host memory runs out at the first two copies out: those victims recompute, later ones swap, every output
    still equals transformers' and the swap space comes back empty."""
    hf, loaded = tiny_model
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, **MODES["preempt"]))
    copy_out, failures = engine._copy_out, []

    def failing(kv, ids):  # type: ignore[no-untyped-def]
        if len(failures) < 2:
            failures.append(len(ids))
            raise RuntimeError("out of host memory (injected)")
        return copy_out(kv, ids)

    monkeypatch.setattr(engine, "_copy_out", failing)
    batch = prompts()
    ours = run_staggered(engine, batch)
    for i, p in enumerate(batch):
        assert_same_greedy(hf, p, ours[i], hf_greedy(hf, p, NEW_TOKENS))
    assert len(failures) == 2 and engine.stats.num_swapped_preemptions > 0
    assert engine.stats.num_preemptions >= engine.stats.num_swapped_preemptions + 2
    assert engine.swap_policy.used_blocks == 0 and engine.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_integrity()


def test_logits_within_tolerance(tiny_model):
    """All-position logits of one forward pass against transformers' (fp32; stated tolerance 1e-4)."""
    hf, loaded = tiny_model
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, num_kv_blocks=64))
    tokens = prompts()[-1]
    ours = engine.prompt_logits(tokens)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert engine.num_free_blocks == 64


@pytest.mark.parametrize("native", [True, False])
def test_native_and_torch_decode_paths_agree(tiny_model, native):
    hf, loaded = tiny_model
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, num_kv_blocks=256, use_native_kernels=native))
    batch = prompts(seed=1, n=5)
    outs = engine.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, out in zip(batch, outs):
        assert_same_greedy(hf, p, out.token_ids, hf_greedy(hf, p, 12))
