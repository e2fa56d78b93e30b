"""`EngineConfig.amx`, the one AMX switch: an engine sets the kernels' process-wide switch from it when it is built,
and the launcher's environment (DEEPINFER_AMX=0) reaches it only through the field, at the launch edge."""

from __future__ import annotations

import pytest

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.request import SamplingParams
from deepinfer.kernels import dense_linear as dl
from deepinfer.kernels.amx import amx_allowed
from deepinfer.launch.mesh import engine_config
from deepinfer.launch.topology import WorkerSpec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(not dl.native_available(), reason="dense linear kernel could not be built")
def test_an_engine_built_with_amx_off_keeps_its_prefill_off_the_tiles(tiny_llama, monkeypatch, restore_amx_switch):
    """A prompt of AMX_MIN_ROWS + 2 tokens: its fp32 projections take the tiles with the default config and never
    with `amx=False`. Where the CPU has no tiles a stand-in is registered (the kernel's own fp32 path, same
    arguments), so the test can fail anywhere."""
    calls: list[int] = []
    tiles = dl._fns.get("amx") or dl._fns["native"]
    monkeypatch.setitem(dl._fns, "amx", lambda *a: calls.append(a[5]) or tiles(*a))  # a[5]: the row count
    prompt = [3 + i % 300 for i in range(dl.AMX_MIN_ROWS + 2)]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def engine(**knobs: bool) -> LLMEngine:
        return LLMEngine(tiny_llama, None, EngineConfig(block_size=4, num_kv_blocks=80, max_num_batched_tokens=512,
                                                        **knobs))

    off = engine(amx=False)
    assert not amx_allowed() and not dl.amx_available()
    off.generate([prompt], params)
    assert calls == []

    on = engine()  # the default, amx=True: the last engine built sets the process's switch
    assert amx_allowed() and dl.amx_available()
    on.generate([prompt], params)
    assert calls and all(rows == len(prompt) for rows in calls)


def test_the_launcher_maps_the_environment_onto_the_fields(monkeypatch):
    """DEEPINFER_AMX=0 (like DEEPINFER_DECODE_LOOP=0) is read at the launch edge into the worker's EngineConfig;
    unset or any other value leaves the field on."""
    worker = WorkerSpec("w", "worker", "tcp://127.0.0.1:5570")
    monkeypatch.delenv("DEEPINFER_AMX", raising=False)
    monkeypatch.delenv("DEEPINFER_DECODE_LOOP", raising=False)
    assert engine_config(worker).amx is True and engine_config(worker).decode_loop is True
    monkeypatch.setenv("DEEPINFER_AMX", "0")
    config = engine_config(worker)
    assert config.amx is False and config.decode_loop is True
    monkeypatch.setenv("DEEPINFER_AMX", "1")
    assert engine_config(worker).amx is True
    monkeypatch.setenv("DEEPINFER_DECODE_LOOP", "0")
    assert engine_config(worker).decode_loop is False and engine_config(worker).amx is True
