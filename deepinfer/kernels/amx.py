"""The one switch for the kernels' AMX tile paths: `allow_amx(enabled)` sets it, `amx_allowed()` reads it.

Three kernels have a path on AMX-BF16 tiles: prefill attention (`attention_amx`), fp32 products of many rows
(`dense_linear.dense_linear_amx`) and GGUF-block products of many rows (`quant_linear`'s "amx" route). Each
registers its tile entry point when it loads on a CPU that has the tiles (and Linux grants the tile state),
whatever this switch says, and asks the switch on every call that could take the tiles (`available()`,
`amx_available()`, `auto_route`, ...): switched off, even after the libraries loaded, the next call takes the
path it takes on a CPU without tiles (SDPA, the register kernels, dequantise + GEMM, torch).

It is process-wide, as torch's thread count is, and for the same reason: the kernels are loaded once per
process and shared by every engine and thread in it, so there is one setting per process, not one per
engine. `EngineConfig.amx` sets it when an engine is built (the last engine built wins, as with
`num_threads`); the launcher maps DEEPINFER_AMX=0 onto that field, and nothing below the launch edge reads
the environment. Off is for A/B runs, or for a CPU whose tile path misbehaves.
"""

from __future__ import annotations

__all__ = ["allow_amx", "amx_allowed"]

_allowed = True  # a plain bool: reading and rebinding it are atomic under the GIL


def allow_amx(enabled: bool) -> None:
    """Let the kernels take their AMX tile paths (True, the default) or keep every call off them (False),
    for this whole process, from the next call on."""
    global _allowed
    _allowed = bool(enabled)


def amx_allowed() -> bool:
    """Whether the kernels may take their AMX tile paths (where the CPU has them): see the module docstring."""
    return _allowed
