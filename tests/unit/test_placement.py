"""The prefill cost model (router_cache) on its own: the predicted-time formula, the cap that keeps the last
prompt token computed, and how PrefillDone reports are turned into rates."""

from __future__ import annotations

import pytest

from deepinfer.protocol.messages import Heartbeat, KvEvents, PrefillDone
from deepinfer.services.router_cache import PrefillCostModel
from deepinfer.services.router_placement import Instance
from deepinfer.services.router_state import RouterConfig

BLOCKS = [bytes([i]) * 32 for i in range(10)]  # stand-ins for a 10-block chain (block size 16)


def model_with(**config: float) -> PrefillCostModel:
    return PrefillCostModel(RouterConfig(**config))


def worker(name: str = "w0", queued: int = 0, kvcache: str | None = "kv0") -> Instance:
    return Instance(name, "prefill", "i0", load=Heartbeat("prefill", name, "i0", 1, 1, queued_prompt_tokens=queued),
                    kvcache=kvcache)


def test_predicted_time_is_queue_plus_compute_plus_fetch() -> None:
    model = model_with(prior_prefill_tokens_per_s=100.0, prior_host_fetch_s_per_token=0.001,
                       prior_disk_fetch_s_per_token=0.01)
    model.index.apply(KvEvents("w0", "i0", 0, "device", BLOCKS[:2]), 0.0)
    model.index.apply(KvEvents("kv0", "k0", 0, "host", BLOCKS[2:4]), 0.0)
    model.index.apply(KvEvents("kv0", "k0", 1, "disk", BLOCKS[4:5]), 0.0)
    p = model.predict(worker(queued=50), BLOCKS, prompt_tokens=170)
    assert p.blocks == {"device": 2, "host": 2, "disk": 1} and p.cached_blocks == 5
    assert p.cached_tokens == {"device": 32, "host": 32, "disk": 16} and p.uncached_tokens == 90
    assert p.seconds == pytest.approx((50 + 90) / 100 + 32 * 0.001 + 16 * 0.01)
    # The same prompt on a worker without that daemon: everything is computed.
    cold = model.predict(worker("w1", kvcache=None), BLOCKS, prompt_tokens=170)
    assert (cold.cached_blocks, cold.uncached_tokens) == (0, 170)


def test_a_full_hit_still_computes_the_last_token_and_the_cap_trims_the_slowest_tier() -> None:
    model = model_with()
    model.index.apply(KvEvents("w0", "i0", 0, "device", BLOCKS[:9]), 0.0)
    model.index.apply(KvEvents("kv0", "k0", 0, "disk", BLOCKS[9:]), 0.0)
    p = model.predict(worker(), BLOCKS, prompt_tokens=160)
    assert p.cached_blocks == 10  # what the job reports as expected_cached_blocks
    assert p.cached_tokens == {"device": 144, "host": 0, "disk": 15} and p.uncached_tokens == 1


def test_a_report_with_both_daemon_tiers_splits_fetch_time_by_the_current_estimates() -> None:
    model = model_with(prior_host_fetch_s_per_token=1e-5, prior_disk_fetch_s_per_token=3e-5, estimate_alpha=1.0)
    # 100 host + 100 disk tokens were expected to take 0.004 s; they took 0.008 s: both costs double.
    done = PrefillDone("r", "w0", 400, 200, {"host": 100, "disk": 100}, prefill_s=0.1, fetch_s=0.008)
    model.observe(done)
    assert model.fetch_s_per_token["host"] == pytest.approx(2e-5)
    assert model.fetch_s_per_token["disk"] == pytest.approx(6e-5)
    assert model.rate("w0") == pytest.approx(200 / 0.092)
    # Too few computed tokens to say anything about throughput: the rate stays.
    model.observe(PrefillDone("r2", "w0", 400, 399, {"device": 399}, prefill_s=0.01))
    assert model.rate("w0") == pytest.approx(200 / 0.092)


def test_config_refuses_nonsense_priors() -> None:
    with pytest.raises(ValueError, match="prefill rate positive"):
        RouterConfig(prior_prefill_tokens_per_s=0.0)
    with pytest.raises(ValueError, match="estimate_alpha"):
        RouterConfig(estimate_alpha=0.0)


def test_a_heartbeat_measured_throughput_takes_precedence_over_the_learned_rate() -> None:
    model = model_with(prior_prefill_tokens_per_s=100.0)
    fast = Instance("w0", "prefill", "i0", load=Heartbeat("prefill", "w0", "i0", 1, 1, tokens_per_s=1000.0))
    unmeasured = worker("w1")
    assert model.predict(fast, BLOCKS, prompt_tokens=100).seconds == pytest.approx(100 / 1000)
    assert model.predict(unmeasured, BLOCKS, prompt_tokens=100).seconds == pytest.approx(100 / 100)
