"""Helpers for comparing the engine with Hugging Face transformers on the same weights.

The rule every oracle test applies: greedy tokens must equal transformers' token for token; where
one differs, the oracle's own top-2 logit gap at that position must be a near-tie (< NEAR_TIE), or
the test fails. After such a tie the two continuations legitimately diverge and are not compared.
"""

from __future__ import annotations

import inspect
import random

import torch

from tests import oracle_memo

NEAR_TIE = 1e-3


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy continuation of `prompt`, exactly `n` tokens (EOS ignored); from the oracle memo
    when pytest runs with `--oracle-memo` (tests/oracle_memo.py)."""
    question = [list(prompt), n, inspect.getsource(_hf_greedy)]
    return oracle_memo.remember("greedy", lambda: oracle_memo.model_key(hf_model), question,
                                lambda: _hf_greedy(hf_model, prompt, n))


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' logits [len(tokens), vocab] over `tokens` (one sequence); memoised as `hf_greedy` is."""
    def compute() -> torch.Tensor:
        with torch.inference_mode():
            return hf_model(torch.tensor([tokens])).logits[0]

    return oracle_memo.remember_tensor("logits", lambda: oracle_memo.model_key(hf_model),
                                       [list(tokens), inspect.getsource(hf_logits)], compute)


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        # An explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding.
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def memoised_greedy(hf_model, n: int):  # type: ignore[no-untyped-def]
    """`hf_greedy(hf_model, prompt, n)` as a function of the prompt, each prompt computed once."""
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = hf_greedy(hf_model, prompt, n)
        return memo[tuple(prompt)]

    return greedy


def hf_top2_gap(hf_model, tokens: list[int]) -> float:  # type: ignore[no-untyped-def]
    """Gap between the oracle's two best logits for the token after `tokens`."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([tokens])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(hf_model, prompt: list[int], ours: list[int], ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Equal, or equal up to a position where the oracle itself is at a near-tie."""
    assert len(ours) == len(ref), f"length {len(ours)} != oracle's {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = hf_top2_gap(hf_model, prompt + ref[:i])
            assert gap < NEAR_TIE, (
                f"token {i} differs (ours {a}, oracle {b}) and the oracle's top-2 gap there is {gap:.2e}, "
                f"not a near-tie (< {NEAR_TIE})"
            )
            return


def _no_weight_init():  # type: ignore[no-untyped-def]
    """transformers' context that skips random weight initialisation (moved between major versions)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def hf_model_from_loaded(config, state_dict):  # type: ignore[no-untyped-def]
    """A transformers LlamaForCausalLM holding exactly our (e.g. GGUF-dequantised) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
    )
    names = {"input_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
             "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight"}
    for p in ("q", "k", "v", "o"):
        names[f"{p}_proj"] = f"self_attn.{p}_proj.weight"
        names[f"{p}_bias"] = f"self_attn.{p}_proj.bias"
    hf_sd = {}
    for key, t in state_dict.items():
        if key.startswith("layers."):
            _, i, name = key.split(".", 2)
            hf_sd[f"model.layers.{i}.{names[name]}"] = t
        else:
            hf_sd[{"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight",
                   "lm_head": "lm_head.weight"}[key]] = t
    with _no_weight_init():  # every weight is overwritten below: random init only cost seconds
        model = LlamaForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


class SmolLM2Oracle:
    """SmolLM2 loaded once for a whole test session: our weights, the tokenizer, transformers holding the same
    weights (built on first use: with a warm `--oracle-memo` most sessions never need it), and transformers'
    greedy continuations memoised by prompt. Greedy decoding with EOS ignored is a prefix-closed function (the
    first m of n tokens are the m-token answer), so a memo of the longest continuation asked for answers every
    shorter request; each (prompt, length) is computed at most once."""

    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        from deepinfer.loading.weights import load_model_weights
        from deepinfer.text.tokenizer import Tokenizer

        self.loaded = load_model_weights(path)
        self.tok = Tokenizer.load(path)
        config, state = self.loaded.config, self.loaded.state_dict
        # The key is what the stand-in would be built from: our config and weights, and the code that maps them.
        key = (oracle_memo.weights_key(inspect.getsource(hf_model_from_loaded), repr(config), state)
               if oracle_memo.enabled() else "")
        self.hf = oracle_memo.LazyModel(key, lambda: hf_model_from_loaded(config, state))
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def chat(self, questions: list[str]) -> list[list[int]]:
        """Each question as a one-turn chat prompt."""
        return [self.tok.encode_chat([{"role": "user", "content": q}]) for q in questions]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """transformers' greedy `n` tokens after `prompt` (EOS ignored)."""
        known = self._greedy.get(tuple(prompt), [])
        if len(known) < n:
            known = self._greedy[tuple(prompt)] = hf_greedy(self.hf, prompt, n)
        return known[:n]


def smollm2_case(oracle: SmolLM2Oracle, questions: list[str], new_tokens: int):  # type: ignore[no-untyped-def]
    """(loaded, tokenizer, hf model, the questions as chat prompts, transformers' greedy `new_tokens` for each)."""
    prompts = oracle.chat(questions)
    return oracle.loaded, oracle.tok, oracle.hf, prompts, [oracle.greedy(p, new_tokens) for p in prompts]


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    """n seeded token ids in [3, vocab) (below 3: the tiny configs' special ids)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def oracle_prompts(vocab: int) -> list[list[int]]:
    """The MoE oracle tests' prompts: lengths around block and chunk edges."""
    return [random_tokens(n, n, vocab) for n in (1, 3, 7, 16, 17, 33, 48, 64, 70)]


def run_staggered(e, batch: list[list[int]], params, stagger: bool = True) -> list:  # type: ignore[no-untyped-def]
    """Final outputs in prompt order, each run to max_tokens; with `stagger`, three prompts join every third step."""
    from deepinfer.engine.request import FinishReason

    pending = list(enumerate(batch))
    ids: dict[str, int] = {}
    final: dict[int, object] = {}
    steps = 0
    while pending or e.has_unfinished():
        if pending and (not stagger or steps % 3 == 0):
            for _ in range(3 if stagger else len(pending)):
                if pending:
                    i, p = pending.pop(0)
                    ids[e.add_request(f"p{i}", p, params)] = i
        for out in e.step():
            if out.finished:
                assert out.finish_reason == FinishReason.LENGTH
                final[ids[out.request_id]] = out
        steps += 1
    return [final[i] for i in range(len(batch))]


def assert_whole(e) -> None:  # type: ignore[no-untyped-def]
    """Nothing running, every KV block back in the pool and no swapped copy left, the pool's books consistent."""
    assert not e.has_unfinished() and e.num_free_blocks == e.pool.num_blocks
    assert e.swap_policy is None or e.swap_policy.used_blocks == 0
    e.pool.check_integrity()
