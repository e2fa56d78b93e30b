"""Who gets in: `RouterCore`'s admission (`AdmissionMixin`) — the refusals at arrival, the TTFT SLO at a
request's first placement, and the queue's accounting they read.

* Admission happens at arrival, from an estimate of the prompt's tokens (len(prompt_token_ids), else a
  quarter of the characters). "Queued" means not yet decoding: tokenizing, waiting for placement or in
  prefill. Past `max_queued_requests`, or past `max_queued_prompt_tokens` with anything else queued
  (a lone prompt is never refused for its size: the tokenizer bounds it by the context), the request is
  refused at once with `overloaded` (as with a tenant at its in-flight cap or its queued prompt-token cap,
  or a draining router); with no live tokenizer it is refused with `unavailable` (both carry
  retry_after_s), and so it is with no live worker (pair) unless one was live within the last
  `placement_timeout_s`: then it is admitted and waits parked (router_core) for one to come back — the only
  prefill worker restarting or drained in a rolling restart loses no request. When the encoding gives the
  exact count, it replaces the estimate, and a request that then breaks a token limit (with others
  queued) ends with `overloaded` before any prefill is spent on it.
* Load shedding: while the prefill backlog's predicted wait (every prompt token ahead — queued on the
  live prefill-capable workers and not yet placed — over their summed measured rates:
  `PrefillCostModel.backlog_s`) is over `max_queue_wait_s`, a new request is refused at once with
  `overloaded` and a retry_after_s of the excess (at least `retry_after_s`, at most a minute), instead of
  joining a queue it would wait in for longer. Every `overloaded` refusal is counted by cause (`shed`).
* TTFT SLOs (`RouterConfig.ttft_slo_s`, tightened per request): refused with `overloaded` (shed cause
  ttft_slo) at arrival when the backlog's predicted wait alone is over the SLO, and at the first placement
  when the wait so far plus the chosen worker's predicted prefill is; the ratio of each request's actual TTFT
  to that prediction is kept (`ttft_over_predicted`) as the predictor's error.
* TPOT SLOs (`RouterConfig.tpot_slo_s`, tightened per request): at its first placement a request skips the
  decode workers whose measured cadence (`token_cadence`) predicts, with it added, a time per token over its SLO
  or over the tightest SLO of a stream already there (promises are kept on `Instance.tpot_slos`); with none
  left it ends with `overloaded` (shed cause tpot_slo). Actual over predicted TPOT is kept as that
  predictor's error (`tpot_over_predicted`).
* Tenancy: `config.tenants` maps api_key → cache salt; an unknown or missing key gets
  `default_cache_salt`, or `unauthorized` when `require_api_key`. Clients never send a salt. A key that
  no tenant setting names falls under the one anonymous tenant (`RouterConfig.known_tenant`): made-up
  keys share its quotas instead of each getting fresh ones.

A refusal is a `Refusal` (code, message, shed cause, retry hint); the core sends it as the client's ErrorReply,
counted in `rejected` (and by cause in `shed` when it is `overloaded`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.protocol.messages import ErrorCode, GenerateRequest
from deepinfer.services.router_placement import Instance
from deepinfer.services.router_state import Phase, RouterRequest
from deepinfer.services.token_cadence import predict_tpot

if TYPE_CHECKING:
    from deepinfer.services.router_cache import Chosen, PrefillCostModel
    from deepinfer.services.router_placement import InstanceTable
    from deepinfer.services.router_state import RouterConfig, RouterMetrics

UNPLACED = (Phase.TOKENIZING, Phase.PARKED)  # phases in which no worker has the request
MAX_RETRY_AFTER_S = 60.0  # the longest retry_after_s a shed request is given


@dataclass(frozen=True)
class Refusal:
    code: ErrorCode
    message: str
    shed: str | None = None  # the cause an `overloaded` refusal is counted under
    retry_after_s: float | None = None  # None: the config's retry_after_s for overloaded and unavailable


class AdmissionMixin:
    """The admission of `RouterCore` (module docstring). It places through the core's `_choose`."""

    # The core's state this part uses, set by `RouterCore.__init__`.
    config: RouterConfig
    table: InstanceTable
    metrics: RouterMetrics
    cache: PrefillCostModel
    draining: bool
    queued_requests: int
    queued_tokens: int
    unplaced_tokens: int
    _servable_at: float
    _inflight_by_tenant: Counter[str]
    _queued_tokens_by_tenant: Counter[str]

    def _admit(self, req: GenerateRequest, tenant: str, estimate: int, slo: float | None,
               now: float) -> Instance | Refusal:
        """The tokenizer a valid, authorised request goes to, or why it is refused now (in this order: the
        router draining, the queue's and the tenant's limits, no live worker, no live tokenizer, the predicted
        backlog over `max_queue_wait_s`, then over the request's TTFT SLO)."""
        cfg = self.config
        if self.draining:
            return Refusal("overloaded", "the router is shutting down", "draining")
        if self.queued_requests >= cfg.max_queued_requests:
            return Refusal("overloaded", f"queue full: {self.queued_requests} requests waiting", "queue_requests")
        if self.queued_requests and self.queued_tokens + estimate > cfg.max_queued_prompt_tokens:
            return Refusal("overloaded", f"queue full: {self.queued_tokens} prompt tokens waiting", "queue_tokens")
        cap = cfg.max_inflight_per_tenant.get(tenant, cfg.default_max_inflight_per_tenant)
        if cap is not None and self._inflight_by_tenant[tenant] >= cap:
            return Refusal("overloaded", f"this tenant already has {cap} requests in flight", "tenant_inflight")
        tenant_queued, tenant_cap = self._queued_tokens_by_tenant[tenant], self._tenant_token_cap(tenant)
        if tenant_cap is not None and tenant_queued and tenant_queued + estimate > tenant_cap:
            return Refusal("overloaded", f"this tenant already has {tenant_queued} prompt tokens waiting",
                           "tenant_tokens")
        if self.table.place(estimate, req.params.max_tokens, now) is not None:
            self._servable_at = now
        elif now - self._servable_at > cfg.placement_timeout_s:
            return Refusal("unavailable", "no live prefill/decode workers")
        tokenizer = self.table.pick_tokenizer(now)
        if tokenizer is None:
            return Refusal("unavailable", "no live tokenizer")
        wait = self.cache.backlog_s(self.table, self.unplaced_tokens, now)
        if cfg.max_queue_wait_s is not None and wait is not None and wait > cfg.max_queue_wait_s:
            # The hint: how long the backlog takes to drain below the bound at the predicted rate.
            msg = f"overloaded: the predicted wait is {wait:.1f}s (the bound is {cfg.max_queue_wait_s:g}s)"
            return Refusal("overloaded", msg, "predicted_wait", self._retry_after(wait - cfg.max_queue_wait_s))
        if slo is not None and wait is not None and wait > slo:  # the wait alone misses it: refused unencoded
            return Refusal("overloaded", f"the predicted wait is {wait:.2f}s, over the SLO of {slo:g}s", "ttft_slo",
                           self._retry_after(wait - slo))
        return tokenizer

    def _within_slos(self, st: RouterRequest, chosen: Chosen, now: float) -> Chosen | Refusal:
        """At its first placement: `chosen`, or another placement whose decode worker keeps the TPOT SLOs (of
        `st` and of the streams there), with the TTFT predicted within `st`'s SLO; else the refusal (counted)."""
        slow: set[str] = set()
        while not st.resumed and (refusal := self._misses_tpot(st, chosen[0].decode)) is not None:
            slow.add(chosen[0].decode.name)
            again = self._choose(st, now, exclude=slow | st.avoid)
            if again is None:
                self.metrics.shed["tpot_slo"] += 1
                return refusal
            chosen = again
        st.predicted_ttft_s = now - st.arrival + chosen[1].seconds
        return self._misses_slo(st) or chosen

    def _misses_slo(self, st: RouterRequest) -> Refusal | None:
        """At its first placement: the refusal of a request whose predicted TTFT is over its SLO (counted)."""
        slo, predicted = st.ttft_slo_s, st.predicted_ttft_s
        if slo is None or predicted is None or predicted <= slo:
            return None
        self.metrics.shed["ttft_slo"] += 1
        return Refusal("overloaded", f"the predicted time to first token is {predicted:.2f}s, over the SLO of "
                       f"{slo:g}s", "ttft_slo", self._retry_after(predicted - slo))

    def _misses_tpot(self, st: RouterRequest, decode: Instance) -> Refusal | None:
        """At its first placement: why `st` may not decode on `decode` — its measured cadence predicts, with
        one more stream, tokens slower than `st`'s TPOT SLO or than the tightest one promised to a stream
        there — or None (also where nothing is promised or nothing measured). Records the prediction."""
        points = decode.load.tpot_by_batch if decode.load is not None else []
        st.predicted_tpot_s = predicted = predict_tpot(points, decode.batch + 1)
        limits = [s for s in (st.tpot_slo_s, decode.tightest_tpot_slo) if s is not None]
        if predicted is None or not limits or predicted <= min(limits):
            return None
        if st.tpot_slo_s is not None and predicted > st.tpot_slo_s:
            why = f"the predicted time per output token is {predicted:.3f}s, over the SLO of {st.tpot_slo_s:g}s"
        else:
            why = (f"another stream would slow the decode workers' streams to {predicted:.3f}s per token, over "
                   f"the {min(limits):g}s promised to one of them")
        return Refusal("overloaded", why, "tpot_slo", self.config.retry_after_s)

    def _retry_after(self, excess_s: float) -> float:
        """The retry hint of a refusal over a bound by `excess_s`: at least `retry_after_s`, at most a minute."""
        return min(MAX_RETRY_AFTER_S, max(self.config.retry_after_s, excess_s))

    # ----- the queue's accounting -----
    # A queued request (admitted, not decoding yet) counts once in queued_requests, its queued_charge in
    # queued_tokens and in its tenant's queued tokens, and also in unplaced_tokens while no worker has it
    # (TOKENIZING, PARKED). Every change of those goes through the four methods below.

    def _enqueue(self, st: RouterRequest, charge: int) -> None:
        assert not st.queued
        st.queued, st.queued_charge = True, charge
        self.queued_requests += 1
        self._count_charge(st, charge)

    def _recharge(self, st: RouterRequest, charge: int) -> None:
        if st.queued:
            self._count_charge(st, charge - st.queued_charge)
        st.queued_charge = charge

    def _dequeue(self, st: RouterRequest) -> None:
        if st.queued:
            self.queued_requests -= 1
            self._count_charge(st, -st.queued_charge)
            st.queued = False

    def _set_phase(self, st: RouterRequest, phase: Phase) -> None:
        if st.queued:
            self.unplaced_tokens += st.queued_charge * ((phase in UNPLACED) - (st.phase in UNPLACED))
        st.phase = phase

    def _count_charge(self, st: RouterRequest, tokens: int) -> None:
        self.queued_tokens += tokens
        if st.phase in UNPLACED:
            self.unplaced_tokens += tokens
        self._queued_tokens_by_tenant[st.tenant] += tokens
        if not self._queued_tokens_by_tenant[st.tenant]:
            del self._queued_tokens_by_tenant[st.tenant]

    def _tenant_token_cap(self, tenant: str) -> int | None:
        cfg = self.config
        return cfg.max_queued_prompt_tokens_per_tenant.get(tenant, cfg.default_max_queued_prompt_tokens_per_tenant)

    def _over_token_limits(self, st: RouterRequest) -> tuple[str, str] | None:
        """(shed cause, message) when the queue, counting `st` exactly, breaks the router's or its tenant's
        prompt-token limit while others wait too (a lone prompt is never refused for its size); else None."""
        if self.queued_requests > 1 and self.queued_tokens > self.config.max_queued_prompt_tokens:
            return "queue_tokens", f"queue full: {self.queued_tokens} prompt tokens waiting"
        cap, mine = self._tenant_token_cap(st.tenant), self._queued_tokens_by_tenant[st.tenant]
        if cap is not None and mine > cap and mine > st.queued_charge:
            return "tenant_tokens", f"this tenant has {mine} prompt tokens waiting"
        return None
