"""An expert-parallel worker group end to end, as an operator runs it: `deepinfer-launch up --ep 2` serves a
tiny random-weight Mixtral (SmolLM2's tokenizer) with the co-located worker as two ranks; a `kill -9` of
rank 1 under load stops and restarts the whole group, every request in flight ends exactly once (its stream
complete and contiguous, or a typed error), and the mesh serves again.

No timing assertions: every wait is bounded only so that a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, Client, MeshError

pytestmark = pytest.mark.smollm2  # the tokenizer comes from SmolLM2's GGUF

NUM_STREAMS = 6
MAX_TOKENS = 64
# How a request in flight on a broken group may end instead of finishing: moved but no live worker took it
# in time (the group reloads its model), or refused while no worker was up. Never `internal` (a request
# rank 0 was adding when the collective broke is moved like the rest) and never a client timeout.
LOST_GROUP_ERRORS = ("worker_lost", "unavailable")


@pytest.fixture(scope="module")
def tiny_mixtral(smollm2_path, tmp_path_factory) -> Path:
    """A 2-layer, 4-expert Mixtral with random weights and SmolLM2's tokenizer files."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from deepinfer.loading.derive_moe import tokenizer_files

    path = tmp_path_factory.mktemp("tiny-mixtral")
    files = tokenizer_files(smollm2_path, 2048)
    config = MixtralConfig(vocab_size=49152, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    MixtralForCausalLM(config).eval().save_pretrained(path)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def group_pids(run_dir: Path) -> dict[int, int]:
    """rank → pid of the running ranks of worker-0 (from their command lines)."""
    out = subprocess.run(["pgrep", "-f", "--", f"--topology {run_dir}/topology.toml --name worker-0"],
                         capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, out):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        ranks[int(argv[argv.index(b"--rank") + 1]) if b"--rank" in argv else 0] = pid
    return ranks


async def streams_killing_rank_1(endpoint: str, run_dir: Path) -> list[tuple[list[int], list[object]]]:
    """Stream NUM_STREAMS requests; once tokens flow, kill -9 rank 1. Per stream: its tokens, and every
    way it ended (a RequestFinished or an exception) — exactly one is wanted."""
    results: list[tuple[list[int], list[object]]] = [([], []) for _ in range(NUM_STREAMS)]
    flowing = asyncio.Event()
    async with AsyncClient(endpoint, timeout_s=300) as c:

        async def one(i: int) -> None:
            tokens, ends = results[i]
            try:
                async for msg in c.stream(prompt=f"Tell me fact number {i} about the sea.", max_tokens=MAX_TOKENS,
                                          ignore_eos=True):
                    if isinstance(msg, m.StreamDelta):
                        assert msg.offset == len(tokens), (i, msg.offset, len(tokens))  # no gap, no repeat
                        tokens += msg.token_ids
                        flowing.set()
                    else:
                        ends.append(msg)
            except Exception as exc:
                ends.append(exc)

        tasks = [asyncio.ensure_future(one(i)) for i in range(NUM_STREAMS)]
        await asyncio.wait_for(flowing.wait(), 240)
        os.kill(group_pids(run_dir)[1], signal.SIGKILL)
        await asyncio.gather(*tasks)
    return results


def serves(endpoint: str) -> bool:
    try:
        with Client(endpoint, timeout_s=30) as c:
            return len(c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True).token_ids) == 4
    except MeshError:
        return False


def test_up_ep_2_serves_and_a_dead_rank_restarts_its_group(tiny_mixtral, tmp_path):
    pytest.importorskip("deepinfer.services.group.follower")
    run_dir = tmp_path / "run"
    with open(tmp_path / "up.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.launch.cli", "--log-level", "info", "up", "--model", str(tiny_mixtral),
             "--colocated", "--ep", "2", "--threads", "2", "--kv-cache-mb", "32", "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert "ready" in proc.stdout.readline()
        endpoint = proc.stdout.readline().strip()
        before = group_pids(run_dir)
        assert sorted(before) == [0, 1]
        with Client(endpoint, timeout_s=120) as c:
            assert len(c.generate(prompt="Hello", max_tokens=8, ignore_eos=True).token_ids) == 8

        results = asyncio.run(streams_killing_rank_1(endpoint, run_dir))
        for i, (tokens, ends) in enumerate(results):
            assert len(ends) == 1, (i, ends)  # every request ends exactly once
            end = ends[0]
            if isinstance(end, m.RequestFinished):
                assert end.token_ids == tokens and len(tokens) == MAX_TOKENS, i
            else:
                assert isinstance(end, MeshError) and end.code in LOST_GROUP_ERRORS, (i, end)

        # The whole group was restarted: both ranks are new processes, and the mesh serves again.
        deadline = time.monotonic() + 300
        while not serves(endpoint):
            assert time.monotonic() < deadline, "the mesh did not serve again"
            time.sleep(1)
        after = group_pids(run_dir)
        assert sorted(after) == [0, 1] and after[0] != before[0] and after[1] != before[1]
        assert "stopping the rest of a broken group" in (tmp_path / "up.log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    assert code == 0
    assert group_pids(run_dir) == {}  # every rank stopped with `up`
