"""Conditional disaggregation (router_cache): with a prefill/decode pair to choose from, a request is prefilled
on its decode worker when that is predicted no slower than a prefill worker plus the KV handoff, and leaves
at most `local_prefill_max_tokens` to compute there. Scripted heartbeats set the measured rates."""

from __future__ import annotations

import pytest
import structlog.testing

from deepinfer.protocol.messages import PrefillDone, PrefillJob, RequestFinished, TextDeltaItem
from deepinfer.services.router_cache import PrefillCostModel
from deepinfer.services.router_state import RouterConfig
from tests.unit.test_router_core import KvMesh, assert_clean, chain, msgs


def pair(max_local: int = 256, running: int = 0) -> KvMesh:
    """One tokenizer, one prefill worker (1,000 tokens/s), one decode worker with `running` streams (its
    heartbeat's rate is of decode steps: not a prefill rate)."""
    mesh = KvMesh(RouterConfig(heartbeat_timeout_s=3.0, local_prefill_max_tokens=max_local), tok0="tokenizer")
    mesh.beat("pre0", "prefill", tokens_per_s=1000.0)
    mesh.beat("dec0", "decode", tokens_per_s=100.0, running=running)
    return mesh


def finish(mesh: KvMesh, job: PrefillJob, worker: str) -> RequestFinished:
    mesh.core.on_prefill_done(PrefillDone(job.request_id, worker, len(job.token_ids), 0, prefill_s=0.1), mesh.now)
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "z", [7], True, "length"), worker=worker)
    [fin] = msgs(out, RequestFinished)
    return fin


def test_a_short_prompt_prefills_on_its_decode_worker_and_finishes_there() -> None:
    mesh = pair()
    job, dest = mesh.job(40)  # 40 ms there (at the prefill worker's rate) against 40 ms + a 3-block handoff
    assert dest == "dec0" and job.decode_worker == "dec0"
    assert mesh.core.request(job.request_id).where.prefill == "dec0"
    assert mesh.core.metrics.prefill_sites == {"local": 1}
    assert finish(mesh, job, "dec0").token_ids == [7]
    assert_clean(mesh.core)


def test_a_prefill_that_would_stall_running_streams_more_than_it_gains_goes_to_the_prefill_worker() -> None:
    mesh = pair(running=8)
    job, dest = mesh.job(200)  # gains the 26 ms handoff, stalls 8 streams 0.2 s each
    assert (dest, job.decode_worker) == ("pre0", "dec0")
    big = pair(max_local=100)
    big.beat("pre0", "prefill", tokens_per_s=1000.0, queued_prompt_tokens=50_000)  # a long queue, still...
    job, dest = big.job(200)
    assert dest == "pre0"  # ...200 tokens to compute is over the bound
    assert mesh.core.metrics.prefill_sites == {"remote": 1} and big.core.metrics.prefill_sites == {"remote": 1}


def test_a_long_prefill_queue_sends_prompts_to_their_decode_worker() -> None:
    mesh = pair(running=8)
    mesh.beat("pre0", "prefill", tokens_per_s=1000.0, queued_prompt_tokens=2000)  # 2 s of queue
    job, dest = mesh.job(200)  # gains 2.03 s, stalls 8 streams 0.2 s each
    assert dest == "dec0"
    mesh.beat("dec0", "decode", tokens_per_s=100.0, running=12)  # 2.4 s of stall: no longer worth it
    assert mesh.job(200, salt="other")[1] == "pre0"  # another prompt: none of it is being computed on dec0


def test_a_prompt_cached_on_the_decode_workers_device_prefills_there() -> None:
    mesh = pair(running=8)
    mesh.kv("dec0", "device", chain(992))  # 62 of the prompt's 63 full blocks: 32 + 8 tokens left there
    job, dest = mesh.job(1000)
    assert dest == "dec0" and job.expected_cached_blocks == 62
    cold, dest = mesh.job(1000, salt="other")  # another tenant's: nothing cached, 1,000 tokens to compute
    assert dest == "pre0"


def test_off_by_default_and_with_least_loaded_placement() -> None:
    for config in (RouterConfig(heartbeat_timeout_s=3.0),
                   RouterConfig(heartbeat_timeout_s=3.0, local_prefill_max_tokens=256, placement="least_loaded")):
        mesh = KvMesh(config, tok0="tokenizer")
        mesh.beat("pre0", "prefill", tokens_per_s=1000.0)
        mesh.beat("dec0", "decode", tokens_per_s=500.0)
        assert mesh.job(8)[1] == "pre0"


def test_co_located_workers_are_unaffected() -> None:
    mesh = KvMesh(RouterConfig(heartbeat_timeout_s=3.0, local_prefill_max_tokens=256), tok0="tokenizer")
    mesh.beat("w0", "worker", tokens_per_s=500.0)
    job, dest = mesh.job(40)
    assert dest == "w0" and job.decode_worker == "w0" and not mesh.core.metrics.prefill_sites


def test_the_handoff_cost_is_learnt_from_prefill_done_and_taken_out_of_the_compute_rate() -> None:
    model = PrefillCostModel(RouterConfig(estimate_alpha=1.0, prior_prefill_tokens_per_s=100.0))
    model.observe(PrefillDone("r", "pre0", 160, 0, prefill_s=0.5, fetch_s=0.1, handoff_s=0.2))
    assert model.handoff_s_per_block == pytest.approx(0.02)  # 0.2 s over 10 blocks
    assert model.rate("pre0") == pytest.approx(800.0)  # 160 tokens in 0.5 − 0.1 − 0.2 s


def test_every_placement_is_logged_with_its_reasons() -> None:
    mesh = pair(running=8)
    mesh.kv("dec0", "device", chain(992))
    with structlog.testing.capture_logs() as logs:
        mesh.job(1000)  # cached on the decode worker: local
        mesh.job(1000, salt="other")  # nothing cached: remote
    placed = [e for e in logs if e["event"] == "prefill placed"]
    assert [(e["site"], e["prefill"], e["decode"], e["cached_blocks"]) for e in placed] == [
        ("local", "dec0", "dec0", 62), ("remote", "pre0", "dec0", 0)]
    assert all(e["log_level"] == "debug" and e["policy"] == "cache_aware" and e["predicted_s"] > 0 for e in placed)


def test_always_local_prefills_every_request_on_its_decode_worker() -> None:
    """prefill_site = "local" (the always-local baseline): even a prompt conditional disaggregation sends to the
    prefill worker (it would stall 8 streams) prefills where it decodes; an unknown site is refused."""
    mesh = KvMesh(RouterConfig(heartbeat_timeout_s=3.0, prefill_site="local"), tok0="tokenizer")
    mesh.beat("pre0", "prefill", tokens_per_s=1000.0)
    mesh.beat("dec0", "decode", tokens_per_s=100.0, running=8)
    job, dest = mesh.job(2000)
    assert (dest, job.decode_worker) == ("dec0", "dec0")
    assert mesh.core.metrics.prefill_sites == {"local": 1}
    assert finish(mesh, job, "dec0").token_ids == [7]
    assert_clean(mesh.core)
    with pytest.raises(ValueError, match="prefill_site must be one of conditional, local"):
        RouterConfig(prefill_site="remote")
