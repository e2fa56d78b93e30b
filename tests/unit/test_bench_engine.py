"""bench/bench_engine.py: the bytes-per-token and bandwidth arithmetic, and the llama.cpp peer's batched
greedy decoding (skipped when llama-cpp-python, a `bench` extra, is not installed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.bench_engine import (
    LlamaCpp,
    bandwidth_fraction,
    gguf_weight_bytes,
    import_llama_cpp,
    make_prompts,
    model_weight_bytes,
    same_prefix,
)


@dataclass
class _Packed:  # what model_weight_bytes needs of a PackedWeight
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


@dataclass
class _Mlp:
    gate_up: object
    down: object


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: object
    qkv_bias: torch.Tensor | None
    o_proj: object
    mlp: _Mlp


class _Model:
    def __init__(self, tied: bool) -> None:
        self.embed = _Packed(torch.zeros(1000, dtype=torch.uint8))
        self.norm = torch.zeros(8)  # 32 bytes
        self.lm_head = self.embed if tied else torch.zeros(10, 8)  # 320 bytes untied
        shared = _Packed(torch.zeros(7, dtype=torch.uint8))
        self.layers = [_Layer(torch.zeros(8), _Packed(torch.zeros(100, dtype=torch.uint8)), None, shared,
                              _Mlp(_Packed(torch.zeros(200, dtype=torch.uint8)), shared)) for _ in range(2)]


def test_weight_bytes_skip_the_looked_up_embedding_and_count_shared_weights_once() -> None:
    # per layer: norm 32 + qkv 100 + gate_up 200; `shared` (o_proj and down of both layers) 7 once; final norm 32
    layers = 2 * (32 + 100 + 200) + 7 + 32
    assert model_weight_bytes(_Model(tied=False)) == layers + 320
    assert model_weight_bytes(_Model(tied=True)) == layers + 1000  # the tied embedding is the LM head


def test_bandwidth_fraction() -> None:
    assert bandwidth_fraction(100e6, 50.0, 10e9) == pytest.approx(0.5)
    assert bandwidth_fraction(None, 50.0, 10e9) is None
    assert bandwidth_fraction(100e6, float("nan"), 10e9) is None
    assert same_prefix([1, 2, 3], [1, 2, 4]) == 2 and same_prefix([5], [5]) == 1


@pytest.mark.smollm2
def test_gguf_weight_bytes_count_the_tied_embedding_once(smollm2_path: Path) -> None:
    from deepinfer.config.gguf_metadata import open_gguf

    sizes = {t.name: int(t.n_bytes) for t in open_gguf(smollm2_path).tensors}
    assert "output.weight" not in sizes  # SmolLM2 ties the LM head to the embedding
    assert gguf_weight_bytes(smollm2_path) == sum(sizes.values())


@pytest.mark.smollm2
def test_llama_cpp_batched_greedy_equals_one_sequence_at_a_time(smollm2_path: Path) -> None:
    lc, why = import_llama_cpp()
    if lc is None:
        pytest.skip(why)
    peer = LlamaCpp(lc, smollm2_path, threads=1)  # no thread pool to wait on a busy machine
    try:
        prompts = make_prompts(2, 10, 20, peer.n_vocab, seed=3)
        peer.open(2, 40, n_batch=16)  # a prompt longer than n_batch is prefilled in two llama_decode calls
        together = peer.generate(prompts, 4)
        assert all(len(t) == 4 for t in together["tokens"])
        peer.open(1, 40)
        alone = [peer.generate([p], 4)["tokens"][0] for p in prompts]
    finally:
        peer.close()
    assert together["tokens"] == alone
