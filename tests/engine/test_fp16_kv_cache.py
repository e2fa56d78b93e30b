"""The engine with an fp16 KV cache (`EngineConfig(kv_cache_dtype="float16")`) on the tiny random-weight
models of test_oracle_tiny.

Stated tolerance: logits with an fp16 KV cache are within atol = rtol = 1e-3 of the same engine's with
an fp32 cache and of transformers' (measured: at most 2e-4 on these models, whose logits are at most
~1.4 in magnitude). Greedy outputs equal transformers' on the oracle prompts (up to an oracle near-tie,
tests/engine/oracle.py), with ample memory, chunked prefill and preemption.

Every path that reads the cache (decode rows through the kernel or its torch reference, prefill) reads
the same halves, and on one layer's attention they agree within 1e-5 (tests/unit/
test_paged_attention_fp16.py). Through the model they agree within PATHS_TOL = 2e-4, not 1e-5: a
difference of ~1e-7 in a layer's output (summation order) can move a later layer's K or V across an fp16
rounding boundary, a change of one half-ulp (~5e-4 relative) in that element (measured up to 4e-5 on
these models; fp32 caches agree within 4e-7).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from tests.engine import test_oracle_tiny
from tests.engine import test_speculative as spec
from tests.engine.oracle import assert_same_greedy, hf_greedy
from tests.engine.test_oracle_tiny import MODES, NEW_TOKENS, prompts, run_staggered

BLOCK = 4
FP16 = dict(kv_cache_dtype="float16")
LOGITS_TOL = dict(atol=1e-3, rtol=1e-3)
PATHS_TOL = dict(atol=2e-4, rtol=2e-4)

tiny_model = test_oracle_tiny.tiny_model  # the same fixture: every variant, module-scoped
tiny_draft_dir = spec.tiny_draft_dir  # a one-layer draft model with the tiny Llama's vocabulary


def fp16_engine(loaded, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    return LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, **FP16, **kw))


def decode_row_logits(e: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens`, each token a decode row attending to its context through
    the pool (the paged decode path), not the prefill path `prompt_logits` takes."""
    blocks = e.pool.allocate(-(-len(tokens) // BLOCK))
    try:
        step = layout([Segment(tokens, 0, blocks, rows=True, num_logits=len(tokens))], BLOCK, e.runner.use_native)
        with torch.inference_mode():
            return e.runner.model.forward(step.input_ids, step.positions, e.runner.kv, step.meta, step.logits_rows)
    finally:
        e.pool.free(reversed(blocks))


def test_pool_is_fp16_at_half_the_bytes(tiny_llama):  # type: ignore[no-untyped-def]
    e32 = LLMEngine(tiny_llama, None, EngineConfig(block_size=BLOCK, num_kv_blocks=8))
    e16 = fp16_engine(tiny_llama, num_kv_blocks=8)
    assert e16.kv_spec.dtype_name == "float16" and e16.runner.kv.dtype == torch.float16
    assert e16.runner.kv.shape == e32.runner.kv.shape
    assert 2 * e16.kv_spec.block_nbytes == e32.kv_spec.block_nbytes
    assert e16.kv_spec.layout == e32.kv_spec.layout
    # The same budget buys twice the blocks.
    budget = 64 * e32.kv_spec.block_nbytes
    e32b = LLMEngine(tiny_llama, None, EngineConfig(block_size=BLOCK, kv_cache_bytes=budget))
    e16b = fp16_engine(tiny_llama, kv_cache_bytes=budget)
    assert e16b.pool.num_blocks == 2 * e32b.pool.num_blocks == 128


def test_bfloat16_pool_is_refused(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    """bfloat16 is a wire name the engine's attention does not read: refused when the pool is made."""
    from deepinfer.config.model import ConfigError
    from deepinfer.engine import model_runner

    spec = KvSpec.for_model(tiny_llama.config, BLOCK, "bfloat16")
    with pytest.raises(ConfigError, match="bfloat16"):
        model_runner.ModelRunner(None, EngineConfig(block_size=BLOCK), spec, 4)  # type: ignore[arg-type]


def test_logits_within_tolerance(tiny_model):  # type: ignore[no-untyped-def]
    hf, loaded = tiny_model
    tokens = prompts()[-1]
    e32 = LLMEngine(loaded, None, EngineConfig(block_size=BLOCK, num_kv_blocks=64))
    e16 = fp16_engine(loaded, num_kv_blocks=64)
    ours = e16.prompt_logits(tokens)
    torch.testing.assert_close(ours, e32.prompt_logits(tokens), **LOGITS_TOL)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, **LOGITS_TOL)
    # Decode rows read the pool's halves through the decode path: the same values as prefill read.
    rows = decode_row_logits(e16, tokens)
    torch.testing.assert_close(rows, ours, **PATHS_TOL)
    torch.testing.assert_close(rows, decode_row_logits(e32, tokens), **LOGITS_TOL)
    assert e16.num_free_blocks == 64


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(tiny_model, mode):  # type: ignore[no-untyped-def]
    hf, loaded = tiny_model
    engine = fp16_engine(loaded, **MODES[mode])
    batch = prompts()
    ours = run_staggered(engine, batch)
    for i, p in enumerate(batch):
        assert_same_greedy(hf, p, ours[i], hf_greedy(hf, p, NEW_TOKENS))
    assert engine.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_integrity()
    if mode.startswith("preempt"):
        assert engine.stats.num_preemptions > 0


def test_native_and_torch_decode_paths_agree(tiny_model):  # type: ignore[no-untyped-def]
    """The kernel's fp16 entry point and the torch reference read the same halves: same logits, same tokens."""
    hf, loaded = tiny_model
    native = fp16_engine(loaded, num_kv_blocks=64)
    torch_path = fp16_engine(loaded, num_kv_blocks=64, use_native_kernels=False)
    tokens = prompts()[-1]
    torch.testing.assert_close(decode_row_logits(native, tokens), decode_row_logits(torch_path, tokens), **PATHS_TOL)
    batch = prompts(seed=1, n=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for a, b, p in zip(native.generate(batch, params), torch_path.generate(batch, params), batch):
        assert a.token_ids == b.token_ids
        assert_same_greedy(hf, p, a.token_ids, hf_greedy(hf, p, 12))


@pytest.mark.parametrize("speculative", ["ngram", "self:1", "draft"])
def test_speculation_changes_nothing(tiny_llama, request, speculative):  # type: ignore[no-untyped-def]
    """Verification rows read the fp16 cache like ordinary decode rows: scripted drafts (every acceptance
    length), a self-draft sharing the target's fp16 pool and a draft model with its own pool (in the
    target's dtype) leave the greedy tokens as they were."""
    if speculative == "draft":
        speculative = f"draft:{request.getfixturevalue('tiny_draft_dir')}"
    batch = spec.prompts()
    ref = spec.run(spec.engine(tiny_llama, **FP16), batch, spec.GREEDY)
    e = spec.engine(tiny_llama, speculative, **FP16)
    if speculative == "ngram":
        spec.scripted(e, batch, ref)
    assert e.speculator is not None and e.runner.kv.dtype == torch.float16
    draft_kv = getattr(e.speculator.proposer, "kv", None)
    assert draft_kv is None or draft_kv.dtype == torch.float16
    spec.same(spec.run(e, batch, spec.GREEDY), ref)
    assert e.stats.spec_proposed_tokens > 0
    spec.assert_whole(e)
