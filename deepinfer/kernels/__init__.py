"""Native CPU kernels (plain C, built on first use with the system compiler, loaded with ctypes)."""

from deepinfer.kernels.paged_attention import (
    kernel_cache_dir,
    native_available,
    native_info,
    native_unavailable_reason,
    paged_decode_attention,
    paged_decode_attention_reference,
    rope_write_decode_attention,
    rope_write_decode_attention_reference,
)

__all__ = [
    "kernel_cache_dir",
    "native_available",
    "native_info",
    "native_unavailable_reason",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "rope_write_decode_attention",
    "rope_write_decode_attention_reference",
]
