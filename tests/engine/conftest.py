"""Fixtures for engine tests: a tiny random-weight Llama saved as a Hugging Face directory."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    from deepinfer.loading.weights import load_model_weights

    return load_model_weights(tiny_llama_dir)


@pytest.fixture(scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """One torch thread for a module of tiny models: intra-op threads only add synchronisation, which on a
    loaded machine made each matmul cost milliseconds (40x slower measured with 2 threads on a busy 2-core
    box). A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
