"""What the router records: each request's latencies, tokens and end (from the RequestFinished or
ErrorReply it sends the client), its own counters and queue, the mesh's members, and the worker groups'
expert load. All children are bound once; a label value outside its known set is recorded as "other"."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

from deepinfer.metrics import definitions as d
from deepinfer.metrics.bind import TotalsFeed, bind
from deepinfer.protocol import messages as m

FINISH_REASONS: tuple[str, ...] = get_args(m.FinishReason)
ERROR_CODES: tuple[str, ...] = get_args(m.ErrorCode)
TIERS = ("device", "host", "disk")
ROLES = ("tokenizer", "worker", "prefill", "decode", "kvcache", "balancer")
EVENTS = ("admitted", "retries", "moves", "stale", "kv_events", "resyncs", "forged", "malformed", "refused_deltas",
          "handoffs_adopted", "drains_begun", "drains_finished", "drains_timed_out")
SHED_CAUSES = ("predicted_wait", "queue_requests", "queue_tokens", "tenant_inflight", "tenant_tokens", "draining",
               "ttft_slo", "tpot_slo")
MIGRATION_CAUSES = ("prefill_death", "decode_death", "worker_death", "tokenizer_death", "handoff_failure", "drain",
                    "router_lost")
RESUME_CASES = ("attached", "reclaimed", "readmitted", "reclaim_refused", "refused")
SITES = ("remote", "local")  # where a request with a prefill/decode pair was prefilled
REFUSED_CODES = ("request_too_large", "invalid_request", "bad_message", "other")  # front refusals' reply codes
MAX_GROUPS = 64  # worker groups with their own series; more are not recorded (cardinality bound)
MAX_RANKS = 256


def _known(value: str, known: tuple[str, ...]) -> str:
    return value if value in known else "other"


class RouterExport:
    """The router's metrics (service "router", this instance). `phases`: the names of the router's request
    phases (the router's `Phase` values), each a label value of its in-flight gauge."""

    def __init__(self, instance: str, phases: Sequence[str]) -> None:
        who = ("router", instance)
        self.phases = tuple(phases)
        self.who = who
        self.ttft = bind(d.TIME_TO_FIRST_TOKEN, *who)
        self.itl = bind(d.INTER_TOKEN_LATENCY, *who)
        self.e2e = bind(d.E2E_REQUEST_LATENCY, *who)
        self.queue = bind(d.REQUEST_QUEUE_TIME, *who)
        self.prefill = bind(d.REQUEST_PREFILL_TIME, *who)
        self.prompt_tokens = bind(d.PROMPT_TOKENS, *who)
        self.generation_tokens = bind(d.GENERATION_TOKENS, *who)
        self.queries = bind(d.PREFIX_CACHE_QUERIES, *who)
        self.hits = {t: bind(d.PREFIX_CACHE_HITS, *who, t) for t in (*TIERS, "other")}
        self.success = {r: bind(d.REQUEST_SUCCESS, *who, r) for r in (*FINISH_REASONS, "other")}
        self.errors = {c: bind(d.REQUEST_ERRORS, *who, c) for c in (*ERROR_CODES, "other")}
        self.inflight = {p: bind(d.ROUTER_INFLIGHT, *who, p) for p in (*self.phases, "other")}
        self.slow_clients = bind(d.ROUTER_SLOW_CLIENTS, *who)
        self._refused = {c: bind(d.ROUTER_REFUSED_MESSAGES, *who, c) for c in REFUSED_CODES}
        self.live = {r: bind(d.MESH_LIVE_INSTANCES, *who, r) for r in (*ROLES, "other")}
        self.events = TotalsFeed(lambda e: bind(d.ROUTER_EVENTS, *who, e) if e in EVENTS else None)
        self.shed = TotalsFeed(lambda c: bind(d.ROUTER_SHED, *who, _known(c, SHED_CAUSES)))
        self.migrations = TotalsFeed(lambda c: bind(d.ROUTER_MIGRATIONS, *who, _known(c, MIGRATION_CAUSES)))
        self.ttft_over_predicted = bind(d.TTFT_PREDICTION_RATIO, *who)
        self.tpot_over_predicted = bind(d.TPOT_PREDICTION_RATIO, *who)
        self.prefill_sites = TotalsFeed(lambda s: bind(d.ROUTER_PREFILL_SITES, *who, s) if s in SITES else None)
        self.resumes = TotalsFeed(lambda c: bind(d.ROUTER_RESUMES, *who, c) if c in RESUME_CASES else None)
        self._groups: dict[str, tuple[Any, Any, list[Any], list[Any]]] = {}

    # -- per message to a client ------------------------------------------------------------------------

    def to_client(self, msg: Any) -> None:
        """A message the router sends a client: a request's end is recorded; anything else is ignored."""
        if isinstance(msg, m.RequestFinished):
            self.finished(msg)
        elif isinstance(msg, m.ErrorReply):
            self.errors[_known(msg.code, ERROR_CODES)].inc()

    def refused(self, code: str) -> None:
        """A client message the front refused on decoding, answered with an ErrorReply of `code`."""
        self._refused[_known(code, REFUSED_CODES)].inc()

    def finished(self, msg: m.RequestFinished) -> None:
        t, usage = msg.timings, msg.usage
        self.e2e.observe(t.e2e_s)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        if t.tpot_s is not None:
            self.itl.observe(t.tpot_s)
        if t.queue_s is not None:
            self.queue.observe(t.queue_s)
        if t.prefill_s is not None:
            self.prefill.observe(t.prefill_s)
        self.success[_known(msg.finish_reason, FINISH_REASONS)].inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.queries.inc(usage.prompt_tokens)
        for tier, tokens in usage.cached_by_tier.items():
            if tokens > 0:
                self.hits[_known(tier, TIERS)].inc(tokens)

    # -- periodic ---------------------------------------------------------------------------------------

    def state(self, phases: Mapping[str, int], slow_clients: int, events: dict[str, int],
              members: Iterable[Any]) -> None:
        """The router's gauges and counters now: its requests in flight by phase, slow clients, its event
        totals (monotonic), and its members (objects with `role` and `alive`)."""
        inflight = dict.fromkeys(self.inflight, 0)
        for phase, n in phases.items():
            inflight[_known(phase, self.phases)] += n
        for phase, n in inflight.items():
            self.inflight[phase].set(n)
        self.slow_clients.set(slow_clients)
        self.events.update(events)
        live = dict.fromkeys(self.live, 0)
        for inst in members:
            if inst.alive:
                live[_known(inst.role, ROLES)] += 1
        for role, n in live.items():
            self.live[role].set(n)

    def by_cause(self, shed: Mapping[str, int], migrations: Mapping[str, int],
                 prefill_sites: Mapping[str, int] | None = None, resumes: Mapping[str, int] | None = None) -> None:
        """The router's totals of shed requests and of migrations, each by cause, of prefill placements by
        site, and of resumes by case (all monotonic)."""
        self.shed.update(shed)
        self.migrations.update(migrations)
        self.prefill_sites.update(prefill_sites or {})
        self.resumes.update(resumes or {})

    def ttft_predictions(self, ratios: deque[float], tpot_ratios: deque[float] | None = None) -> None:
        """Take the router's actual-over-predicted TTFT and TPOT samples (emptying the deques)."""
        while ratios:
            self.ttft_over_predicted.observe(ratios.popleft())
        while tpot_ratios:
            self.tpot_over_predicted.observe(tpot_ratios.popleft())

    # -- expert parallelism -------------------------------------------------------------------------------

    def expert_load(self, group: str, load: m.ExpertLoad, max_over_mean: float) -> None:
        """One worker group's load report: tokens and expert assignments per rank over its period, the
        expert imbalance, and the placement version it ran."""
        series = self._groups.get(group)
        if series is None:
            if len(self._groups) >= MAX_GROUPS:
                return
            series = self._groups[group] = (bind(d.EXPERT_PLACEMENT_VERSION, *self.who, group),
                                            bind(d.EXPERT_LOAD_MAX_OVER_MEAN, *self.who, group), [], [])
        version, ratio, rank_tokens, rank_assignments = series
        version.set(load.placement_version)
        ratio.set(max_over_mean)
        ranks = min(len(load.rank_tokens), MAX_RANKS)
        while len(rank_tokens) < ranks:
            rank = str(len(rank_tokens))
            rank_tokens.append(bind(d.EXPERT_RANK_TOKENS, *self.who, group, rank))
            rank_assignments.append(bind(d.EXPERT_RANK_ASSIGNMENTS, *self.who, group, rank))
        for r in range(ranks):
            rank_tokens[r].inc(max(0, load.rank_tokens[r]))
            assigned = sum(layer[r] for layer in load.rank_expert_tokens if r < len(layer))
            if assigned > 0:
                rank_assignments[r].inc(assigned)
