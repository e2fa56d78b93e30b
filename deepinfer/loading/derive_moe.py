"""Derive smollm2-moe: a Mixture-of-Experts model made (not trained) from SmolLM2's dense weights.

Two parts: the derivation (with the plain-torch forward its calibration runs) and the Mixtral-format directory
it is written to and read from. `moe_report.py` measures the result against the dense model.

No MoE weights can be downloaded here, so this module turns a dense Llama-family model into a Mixtral-format
Hugging Face directory, deterministically, with numpy and torch only. The result is a real-weight MoE to serve
and measure — its routing is driven by real activations and is uneven on real text — but it is a derived model:
nothing was trained, and with top-k < E it is much worse than the dense model it came from (figures in the
README; `deepinfer-launch fetch smollm2-moe --report` measures them).

The math. A dense SwiGLU MLP is a sum over its I neurons n, with gate row g_n, up row u_n and down column d_n:

    y(x) = Σ_n d_n · silu(g_n·x) · (u_n·x)

1. Experts. Partition the neurons into E groups S_1..S_E of equal size m = I/E (Mixtral needs equal widths).
   Expert e is the dense MLP restricted to S_e: w1 = W_gate[S_e], w3 = W_up[S_e], w2 = W_down[:, S_e], so
   y = Σ_e f_e(x) exactly. For the groups to be coherent — neurons that open for the same inputs — the
   neurons are clustered by the direction of their gate rows (the gate decides whether a neuron fires:
   silu(t) ≈ 0 for t ≪ 0): balanced spherical k-means on ĝ_n = g_n/|g_n|, k-means++ started from a seeded
   generator, then a balanced assignment (each centroid takes at most m neurons, most similar first)
   alternating with a centroid update until the assignment is stable. This is MoEfication's parameter-
   clustering split (Zhang et al., 2022). It uses the weights only.

2. Router. The router sees the MLP's input x (the post-attention RMSNorm output) and should rank the experts
   by how much each contributes for this token. The target is t_e(x) = log |f_e(x)|, the log-norm of expert
   e's output, measured on the dense model's MLP inputs over a fixed calibration text (deepinfer/data/
   moe_calibration.txt, ~1.2k tokens, distinct from the evaluation text). A Mixtral router is linear with no
   bias, so R is the ridge least-squares fit R = argmin Σ_t |R x_t − t(x_t)|² + λ|R|², t centred over experts
   (softmax ignores a shift common to all logits), λ = 1e-2 · tr(XᵀX)/hidden. The log makes the fit follow
   relative size, so the few tokens with massive activations do not dominate it. On the evaluation text this
   router cuts the E=8, k=4 perplexity 4–5 fold against a weights-only router (each expert's mean gate
   row), though it stays far from the oracle that picks the k largest |f_e(x)| per token.

3. Scaling. Mixtral computes y' = Σ_{e∈T(x)} w_e(x) · f'_e(x) with T(x) the top-k experts of softmax(Rx) and
   w_e = p_e / Σ_{T} p — the weights sum to one, so y' is a weighted *average* of expert outputs where the
   dense MLP is their *sum*. We therefore scale every expert's down projection by s = k (f'_e = k·f_e) and
   scale the router so its logits are small: their spread (std over experts, averaged over calibration
   tokens) is ROUTER_SPREAD. Then every chosen weight is ≈ 1/k and

       y' ≈ Σ_{e∈T(x)} f_e(x)   — the dense MLP with only the chosen experts' neurons.

   (A least-squares scale α on Σ_T f_e comes out at 1.0–1.2 per layer, so s = k is the right size; sharper
   weights hurt: the top-k weights then stray from 1/k; with the weights-only router, E=8, k=4, perplexity was
   1.6k at spread 0.01, 7.6k at 0.1 and 3.2M at 1.0.)
   At k = E every expert is chosen and the router has nothing to decide, so it is written as zeros: every
   weight is exactly 1/E, s = E, and y' = y — the derived model *is* the dense model up to floating-point
   summation order (the tests check this; it checks the split, the scaling and the tensor layout). For
   k < E, y' drops the (E−k)·m neurons of the experts not chosen. SwiGLU neurons are not sparse the way ReLU
   neurons are, so this costs a lot: on the fixed text E=8 gives 1.5x the dense perplexity at k=7, 2.8x at
   k=6, 26x at k=4 and ~3000x at k=2; E=16, k=12 (the default) 2.3x.

Small logits have a price: two experts within fp32 rounding of each other (gaps ~1e-7 against a spread of
1e-2) are picked by index order, so an implementation must select on the same fp32 softmax as transformers.

Determinism: the k-means seed is fixed, and every step is fp32/fp64 arithmetic on fixed inputs, so a run
on the same machine and torch build writes the same bytes (the calibration forward's matmuls could round
differently on another BLAS or thread count, which could move router weights in their last bits).

Both texts in deepinfer/data/ were written for this project and are in the public domain.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer.config.model import ModelConfig

# The defaults keep the model usable: perplexity 32.6 against the dense 14.1 on the fixed text (E=8: k=7 21.4,
# k=6 39.7, k=4 366, k=2 ~42000 — Mixtral's 2-of-8 is not usable without training), and the greedy chat answer
# to "What is the capital of France?" is still "The capital of France is Paris." `bench/moe_skew.py` sweeps.
DEFAULT_NUM_EXPERTS = 16
DEFAULT_TOP_K = 12
DEFAULT_SEED = 0
# Mean std over experts of the router logits on the calibration text: small, so the top-k weights are all
# close to 1/k; far above fp32 rounding (~1e-7), so rounding almost never ties two experts.
ROUTER_SPREAD = 0.01
RIDGE = 1e-2
KMEANS_MAX_ITERS = 50
# Recorded in config.json; change it when the derivation changes what it writes, so a cached directory is
# derived again (v2 writes v1's weights; its README names the module's path under loading/).
DERIVE_METHOD = "gate-kmeans-balanced/lsq-lognorm-router/v2"
DATA = Path(__file__).resolve().parent.parent / "data"
EVAL_TEXT = DATA / "moe_eval.txt"
CALIBRATION_TEXT = DATA / "moe_calibration.txt"


@dataclass(frozen=True)
class MoeLayer:
    router: torch.Tensor  # [E, hidden]
    w1: torch.Tensor  # [E, m, hidden]  gate
    w3: torch.Tensor  # [E, m, hidden]  up
    w2: torch.Tensor  # [E, hidden, m]  down, scaled by top_k
    neurons: np.ndarray  # [E, m] the dense neuron indices of each expert


@dataclass(frozen=True)
class DerivedMoe:
    config: ModelConfig  # the dense model's
    num_experts: int
    top_k: int
    seed: int
    base: dict[str, torch.Tensor]  # the dense state dict less the MLPs (our names)
    layers: list[MoeLayer]


# ----- the derivation -----


def partition_neurons(gate: np.ndarray, num_experts: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """[E, I/E] neuron indices: balanced spherical k-means on the gate rows' directions. Each row is sorted;
    rows are ordered by their smallest index, so the result depends on the weights and the seed only."""
    n = gate.shape[0]
    if n % num_experts:
        raise ValueError(f"intermediate size {n} is not divisible by {num_experts} experts")
    size = n // num_experts
    feats = gate.astype(np.float64)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True) + 1e-12
    centroids = _kmeans_pp(feats, num_experts, np.random.default_rng(seed))
    assign = np.full(n, -1)
    for _ in range(KMEANS_MAX_ITERS):
        new = _balanced_assign(feats @ centroids.T, size)
        if np.array_equal(new, assign):
            break
        assign = new
        for e in range(num_experts):
            c = feats[assign == e].sum(axis=0)
            centroids[e] = c / (np.linalg.norm(c) + 1e-12)
    groups = [np.flatnonzero(assign == e) for e in range(num_experts)]
    groups.sort(key=lambda g: int(g[0]))
    return np.stack(groups)


def _kmeans_pp(feats: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding under cosine distance (1 − cos)."""
    chosen = [int(rng.integers(len(feats)))]
    dist = 1.0 - feats @ feats[chosen[0]]
    for _ in range(1, k):
        p = np.clip(dist, 0.0, None) ** 2
        chosen.append(int(rng.choice(len(feats), p=p / p.sum())))
        dist = np.minimum(dist, 1.0 - feats @ feats[chosen[-1]])
    return feats[chosen].copy()


def _balanced_assign(sims: np.ndarray, size: int) -> np.ndarray:
    """Each neuron to one centroid, each centroid exactly `size` neurons. In rounds: every unplaced neuron
    proposes to its most similar centroid with room left; a centroid keeps its most similar proposers up to
    its room (ties by neuron index) and the rest propose again."""
    n, k = sims.shape
    assign = np.full(n, -1)
    room = np.full(k, size)
    while (free := np.flatnonzero(assign < 0)).size:
        open_sims = np.where(room > 0, sims[free], -np.inf)
        best = open_sims.argmax(axis=1)
        for e in np.unique(best):
            proposers = free[best == e]
            keep = proposers[np.argsort(-sims[proposers, e], kind="stable")[: room[e]]]
            assign[keep] = e
            room[e] -= len(keep)
    return assign


def fit_router(x: np.ndarray, expert_out: np.ndarray) -> np.ndarray:
    """[E, hidden] router from calibration MLP inputs x [T, hidden] and expert outputs [T, E, hidden]:
    ridge least squares onto the centred log-norms of the outputs, scaled to ROUTER_SPREAD."""
    target = np.log(np.linalg.norm(expert_out, axis=-1) + 1e-30)
    target -= target.mean(axis=1, keepdims=True)
    gram = x.T @ x
    ridge = RIDGE * np.trace(gram) / x.shape[1]
    router = np.linalg.solve(gram + ridge * np.eye(x.shape[1]), x.T @ target).T
    router -= router.mean(axis=0, keepdims=True)
    spread = (x @ router.T).std(axis=1).mean()
    return router * (ROUTER_SPREAD / max(spread, 1e-30))


def derive_moe(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    calibration_ids: list[int],
    num_experts: int = DEFAULT_NUM_EXPERTS,
    top_k: int = DEFAULT_TOP_K,
    seed: int = DEFAULT_SEED,
) -> DerivedMoe:
    """Split every layer's MLP of a dense model (our naming contract, fp32) into `num_experts` experts, with
    routers fitted on the dense model's MLP inputs over `calibration_ids`."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    mlp = ("gate_proj", "up_proj", "down_proj")
    base = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] not in mlp}
    mlp_inputs: list[torch.Tensor] = []
    if top_k < num_experts:
        forward(config, state, calibration_ids, mlp_inputs=mlp_inputs)
    layers = []
    for i in range(config.num_layers):
        gate, up, down = (state[f"layers.{i}.{n}"] for n in mlp)
        neurons = partition_neurons(gate.numpy(), num_experts, seed)
        idx = torch.from_numpy(neurons)
        w1, w3, w2 = gate[idx], up[idx], down[:, idx].permute(1, 0, 2)
        if top_k == num_experts:
            router = np.zeros((num_experts, config.hidden_size))
        else:
            x = mlp_inputs[i].double()
            out = torch.stack([F.linear(F.silu(x @ w1[e].double().T) * (x @ w3[e].double().T), w2[e].double())
                               for e in range(num_experts)], dim=1)
            router = fit_router(x.numpy(), out.numpy())
        layers.append(MoeLayer(torch.from_numpy(router).to(torch.float32), w1.contiguous(), w3.contiguous(),
                               (w2 * top_k).contiguous(), neurons))
    return DerivedMoe(config, num_experts, top_k, seed, base, layers)


# ----- a plain-torch forward of the dense or the derived model (calibration here, measurement in moe_report) -----


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _moe_mlp(layer: MoeLayer, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's sparse MoE block: softmax over the router logits, top-k, renormalise, weighted sum."""
    probs = torch.softmax(F.linear(x, layer.router).float(), dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(layer.router.shape[0]):
        rows, slot = torch.where(chosen == e)
        if len(rows):
            xe = x[rows]
            ye = F.linear(F.silu(F.linear(xe, layer.w1[e])) * F.linear(xe, layer.w3[e]), layer.w2[e])
            out.index_add_(0, rows, ye * weights[rows, slot, None])
    return out, chosen


@torch.inference_mode()
def forward(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    ids: list[int],
    moe: DerivedMoe | None = None,
    mlp_inputs: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits [T, vocab] of one sequence, and per MoE layer the chosen experts [T, top_k]. `state` is the
    dense model's (our names); with `moe`, each layer's MLP is the derived MoE block instead. Each layer's
    MLP input is appended to `mlp_inputs` when given."""
    c = config
    t = len(ids)
    h = state["embed_tokens"][torch.tensor(ids)]
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    routes = []
    for i in range(c.num_layers):
        p = f"layers.{i}."
        x = _rms_norm(h, state[p + "input_norm"], c.rms_norm_eps)
        q = F.linear(x, state[p + "q_proj"]).view(t, c.num_heads, c.head_dim).transpose(0, 1)
        k = F.linear(x, state[p + "k_proj"]).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = F.linear(x, state[p + "v_proj"]).view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + F.linear(a.transpose(0, 1).reshape(t, -1), state[p + "o_proj"])
        x = _rms_norm(h, state[p + "post_attn_norm"], c.rms_norm_eps)
        if mlp_inputs is not None:
            mlp_inputs.append(x)
        if moe is None:
            y = F.linear(F.silu(F.linear(x, state[p + "gate_proj"])) * F.linear(x, state[p + "up_proj"]),
                         state[p + "down_proj"])
        else:
            y, chosen = _moe_mlp(moe.layers[i], x, moe.top_k)
            routes.append(chosen)
        h = h + y
    head = state["embed_tokens"] if c.tie_word_embeddings else state["lm_head"]
    return F.linear(_rms_norm(h, state["norm"], c.rms_norm_eps), head), routes


# ----- the Mixtral-format Hugging Face directory -----


def mixtral_config(moe: DerivedMoe, source: str) -> dict[str, object]:
    """config.json: transformers' MixtralConfig fields, plus `deepinfer_derived` saying what this is."""
    c = moe.config
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size // moe.num_experts,  # one expert's width
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids),
        "torch_dtype": "float32",
        "use_cache": True,
        "deepinfer_derived": {
            "trained": False,
            "note": "Derived, not trained: each layer's MLP split into experts by neurons and a router fitted "
            "to the experts' output norms on a calibration text (deepinfer/loading/derive_moe.py). A test and "
            "measurement model, worse than the dense model it was derived from.",
            "source": source,
            "method": DERIVE_METHOD,
            "num_experts": moe.num_experts,
            "top_k": moe.top_k,
            "seed": moe.seed,
            "down_proj_scale": moe.top_k,
            "router_spread": 0.0 if moe.top_k == moe.num_experts else ROUTER_SPREAD,
            "calibration_text": CALIBRATION_TEXT.name,
        },
    }


def mixtral_tensors(moe: DerivedMoe) -> dict[str, torch.Tensor]:
    """The state dict under the tensor names of Mixtral checkpoints (per-expert w1/w2/w3)."""
    names = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
    names |= {f"{p}_proj": f"self_attn.{p}_proj" for p in "qkvo"}
    glob = {"embed_tokens": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
    out: dict[str, torch.Tensor] = {}
    for key, t in moe.base.items():
        if key.startswith("layers."):
            _, i, name = key.split(".", 2)
            out[f"model.layers.{i}.{names[name]}.weight"] = t
        else:
            out[f"{glob[key]}.weight"] = t
    for i, layer in enumerate(moe.layers):
        p = f"model.layers.{i}.block_sparse_moe."
        out[p + "gate.weight"] = layer.router
        for e in range(moe.num_experts):
            out[f"{p}experts.{e}.w1.weight"] = layer.w1[e]
            out[f"{p}experts.{e}.w2.weight"] = layer.w2[e]
            out[f"{p}experts.{e}.w3.weight"] = layer.w3[e]
    return {k: v.contiguous() for k, v in out.items()}


def tokenizer_files(gguf: str | os.PathLike[str], max_length: int) -> dict[str, str]:
    """tokenizer.json and friends, from the GGUF's vocabulary: the same tokenizer for transformers'
    AutoTokenizer and for ours (`Tokenizer.from_dir`)."""
    from deepinfer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.eos_token,
        "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    eos = list(tok.eos_token_ids)
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    files = {
        "tokenizer.json": tok.backend.to_str() + "\n",
        "tokenizer_config.json": _json(config),
        "generation_config.json": _json(generation),
    }
    if tok.chat_template:
        files["chat_template.jinja"] = tok.chat_template
    return files


def write_moe_dir(
    gguf: str | os.PathLike[str],
    out: str | os.PathLike[str],
    num_experts: int = DEFAULT_NUM_EXPERTS,
    top_k: int = DEFAULT_TOP_K,
    seed: int = DEFAULT_SEED,
    source: str | None = None,
) -> None:
    """Derive the MoE from a dense GGUF model and write it as a Mixtral Hugging Face directory into `out`
    (which must not exist). Same inputs, same bytes."""
    from safetensors.torch import save_file

    from deepinfer.loading.weights import load_model_weights
    from deepinfer.text.tokenizer import Tokenizer

    loaded = load_model_weights(gguf)
    calibration = Tokenizer.from_gguf(gguf).encode(CALIBRATION_TEXT.read_text())
    moe = derive_moe(loaded.config, loaded.state_dict, calibration, num_experts, top_k, seed)
    root = Path(out)
    root.mkdir(parents=True)
    save_file(mixtral_tensors(moe), str(root / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(root / "model.safetensors", 0o644)  # safetensors creates it owner-only; the other files are 0o644
    files = tokenizer_files(gguf, loaded.config.max_position_embeddings)
    files["config.json"] = _json(mixtral_config(moe, source or Path(gguf).name))
    files["derivation.json"] = _json({"experts": [layer.neurons.tolist() for layer in moe.layers]})
    files["README.md"] = _readme(moe, source or Path(gguf).name)
    for name, text in files.items():
        (root / name).write_text(text)


def load_moe_dir(path: str | os.PathLike[str]) -> DerivedMoe:
    """Read back a directory written by `write_moe_dir` (for the report; not a general Mixtral loader)."""
    from safetensors import safe_open

    root = Path(path)
    cfg = json.loads((root / "config.json").read_text())
    num_experts, top_k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
    num_shared = int(cfg.get("deepinfer_derived", {}).get("shared_neurons", 0))
    width = (int(cfg["intermediate_size"]) - num_shared) * num_experts + num_shared
    config = ModelConfig.from_hf_dict({**cfg, "model_type": "llama", "intermediate_size": width})
    names = {v: k for k, v in {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                               **{f"{p}_proj": f"self_attn.{p}_proj" for p in "qkvo"}}.items()}
    glob = {"model.embed_tokens": "embed_tokens", "model.norm": "norm", "lm_head": "lm_head"}
    dense: dict[str, torch.Tensor] = {}
    moe_tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(root / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key).to(torch.float32)
            base = key.removesuffix(".weight")
            if ".block_sparse_moe." in key:
                moe_tensors[key] = t
            elif base in glob:
                dense[glob[base]] = t
            else:
                _, _, i, rest = base.split(".", 3)
                dense[f"layers.{i}.{names[rest]}"] = t
    partition = json.loads((root / "derivation.json").read_text())["experts"]
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}.block_sparse_moe."

        def experts(w: str, p: str = p) -> torch.Tensor:
            return torch.stack([moe_tensors[f"{p}experts.{e}.{w}.weight"] for e in range(num_experts)])

        layers.append(MoeLayer(moe_tensors[p + "gate.weight"], experts("w1"), experts("w3"), experts("w2"),
                               np.array(partition[i])))
    seed = int(cfg.get("deepinfer_derived", {}).get("seed", DEFAULT_SEED))
    return DerivedMoe(config, num_experts, top_k, seed, dense, layers)


def _json(obj: object) -> str:
    return json.dumps(obj, indent=2) + "\n"


def _readme(moe: DerivedMoe, source: str) -> str:
    c, e, k = moe.config, moe.num_experts, moe.top_k
    return f"""# smollm2-moe-e{e}-k{k}: derived, not trained

A Mixtral-format model **derived** from the dense {source} by `deepinfer-launch fetch smollm2-moe`
(deepinfer/loading/derive_moe.py, method {DERIVE_METHOD}). Nothing here was trained.

- Each layer's MLP ({c.intermediate_size} neurons) is split into {e} experts of {c.intermediate_size // e} neurons
  by balanced k-means on the neurons' gate rows; derivation.json lists each expert's dense neuron indices.
- The router is a ridge least-squares fit of each expert's output log-norm on a calibration text
  ({CALIBRATION_TEXT.name}), scaled so its logits are small (spread {ROUTER_SPREAD}): the chosen experts'
  weights are all close to 1/{k}.
- {k} of {e} experts run per token; each expert's down projection is multiplied by {k}, so the MoE output is
  about the sum of the chosen experts — the dense MLP without the other experts' neurons.

It exists to serve and measure a real-weight MoE whose routing follows real activations (and is uneven on real
text). With top-k below the number of experts it drops neurons and is worse than the dense model:
`deepinfer-launch fetch smollm2-moe --experts {e} --top-k {k} --report` measures its perplexity against the dense
model and prints the expert-load histogram. The weights keep the source model's licence (SmolLM2: Apache-2.0).
"""
