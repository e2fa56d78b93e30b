"""Huge-page host buffers (deepinfer/kernels/huge_pages.py): what callers rely on, whatever the kernel grants."""

from __future__ import annotations

import gc

import torch

from deepinfer.kernels.huge_pages import HUGE_PAGE, huge_page_bytes, huge_page_zeros


def test_zeros_of_any_shape_and_dtype_on_a_huge_page_boundary() -> None:
    for shape, dtype in (((3, 5, 7), torch.float32), ((4, 2, 16, 3, 64), torch.float16), ((0, 8), torch.float32)):
        t = huge_page_zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
        assert t.data_ptr() % HUGE_PAGE == 0 or t.numel() == 0


def test_writable_and_alive_after_the_mapping_object_is_gone() -> None:
    t = huge_page_bytes(3 * HUGE_PAGE + 123)
    assert t.numel() == 3 * HUGE_PAGE + 123
    gc.collect()  # only the tensor refers to the mapping now
    t[::4096] = 7
    assert int(t[::4096].sum()) == 7 * len(range(0, t.numel(), 4096))
    view = t[HUGE_PAGE:HUGE_PAGE + 40].view(torch.int32)
    del t
    gc.collect()
    view.fill_(-1)
    assert view.tolist() == [-1] * 10


def test_kv_pool_on_cpu_is_zeroed_in_huge_pages() -> None:
    from deepinfer.config.kv import KvSpec
    from deepinfer.config.model import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    pool = KvSpec.for_model(config, 16).allocate(5)
    assert pool.data_ptr() % HUGE_PAGE == 0 and not pool.any() and pool.shape[0] == 5


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_prefault_makes_every_page_resident_up_front() -> None:
    # The lazy buffer costs no memory until touched; the prefaulted one is resident at once, so no later
    # step takes the (on a fragmented VM, compacting) page faults. Linux only (/proc/self/statm).
    size = 64 << 20
    before = _resident_bytes()
    lazy = huge_page_zeros((size // 4,), torch.float32)
    assert _resident_bytes() - before < size // 4
    before = _resident_bytes()
    eager = huge_page_zeros((size // 4,), torch.float32, prefault=True)
    assert _resident_bytes() - before >= size * 9 // 10
    assert not eager.any() and not lazy.any()


def test_kv_pool_is_resident_when_allocated() -> None:
    from deepinfer.config.kv import KvSpec
    from deepinfer.config.model import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=256, intermediate_size=64,
                         num_layers=8, num_heads=4, num_kv_heads=4, head_dim=64)
    spec = KvSpec.for_model(config, 16)
    before = _resident_bytes()
    pool = spec.allocate(256)  # 256 blocks x 8 layers x K/V x 16 tokens x 256 floats = 64 MiB
    assert pool.numel() * 4 == 64 << 20
    assert _resident_bytes() - before >= pool.numel() * 4 * 9 // 10
