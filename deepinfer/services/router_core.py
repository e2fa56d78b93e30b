"""The router's decision core: each request's admission, placement, moves and end, decided event by event.

No sockets, no asyncio, no clock reads: every event carries `now` (Unix seconds, as the shell read it;
durations and deadlines are taken from it) and returns the messages to send as `Outbound` records.

Addresses: `Outbound.dest` is `bytes` for a client (its ZeroMQ ROUTER identity) and `str` for a service
instance (its name, which is also its DEALER identity). Request ids: the router gives every admitted
request its own id, `config.id_prefix` + a counter (the shell puts its incarnation in the prefix to make
ids unique across router restarts); services only see that id, clients only their own. A client may
reuse an id once its request has ended; a duplicate of a live id is refused (`invalid_request`, the
original goes on — the client broke the contract, so its view of that id is ambiguous).

Decisions:
* Admission, load shedding, TTFT SLOs and tenancy: `router_admission` (who gets in, and the queue's
  accounting). A refusal at arrival is an ErrorReply and nothing else; admitted requests end exactly once.
* A request that finds no live worker after encoding waits (parked) up to `placement_timeout_s` for
  one to appear or come back (a restarted worker, e.g. the only prefill worker), then ends with
  `worker_lost`; its deadline applies throughout.
* Prefill placement (`config.placement`): "cache_aware" picks the least predicted prefill time (queue
  ahead, uncached tokens, fetching the cached ones: `router_cache`) from a prefix index fed by KvEvents
  (a broken event stream gets one KvResync; a dead or restarted publisher's blocks are forgotten);
  "least_loaded" the fewest queued prompt tokens. The decode worker is chosen alike either way.
* A failed prefill or KV handoff that is not a death — an ErrorReply from the prefill or decode worker
  while the request is prefilling, other than the request's own fault (`RETRIED_CODES`) — is retried
  once elsewhere before the client sees it: a refused KV reservation (`overloaded` from the prefill
  worker: nothing reached the decode worker) goes under the same id to another decode worker; anything
  else is moved (below: the decode worker may have streamed the first token), its next placement
  avoiding both workers of the failed handoff, or whichever of them it can. With no other worker to try,
  the error goes to the client.
* Text: a request's deltas count only from its tokenizer, and only of the token batches of the workers it
  was placed on (`TextDeltas.worker`: its decode worker, or its prefill worker for the job's first token,
  which the prefill samples and streams itself when that token ends the request): another worker's are
  refused, counted (`refused_deltas`), logged.
* A client whose connection dropped resumes its requests on the next one (`router_resume`): this router
  sends what it missed of a request it holds; one it does not (its predecessor's) it takes back from the
  worker that kept it running (`HeldRequests`, `Reclaim`), or else readmits, continuing from the client's
  output as a move does.
* Client abort ends the request with RequestFinished(finish_reason="abort") carrying the output so far.
  A gone client's requests end the same way but nothing is sent: there is no one to send to.
* Losing a service (its heartbeats stop, it restarts, or the supervisor reports its exit) moves every
  request it held that is not complete yet (`router_moves`): a new service-side id (the old one's late
  messages are then stale), the tokenizer (the same one when it is alive, else another) rebuilds the
  detokenizer state from the output the client has seen (`EncodeRequest.resume_output_ids`), and the
  request is placed anew with prompt + that output, which the worker prefills (cheap where the prefix
  cache has it) before continuing at the next output position. Greedy output, and a seeded request's
  draws (keyed by output position), are those of an undisturbed run; the client's stream continues
  without a gap or a repeat.
  After `max_moves` moves, or with no live tokenizer, it ends with `worker_lost`. Moves are counted by
  cause (`migrations`). A prefill worker is no longer needed once its KV is installed on the decode
  worker: a request whose decode worker made a token of its own (past the first, which it streams before
  installing the KV) is not moved when its prefill worker is lost before PrefillDone came; it decodes on.
* Decode can finish before PrefillDone reaches us (they travel different paths). The request then waits
  in FINISHING for PrefillDone (for its cached-token usage); losing the prefill worker, timing out or an
  abort in that state delivers the finished result without those numbers, as the output is complete.

Invariant: every admitted request ends exactly once — one RequestFinished or ErrorReply to its client
(unless the client is gone) — through `_end`, which also tells every service still holding it to drop
it and removes all its state. Messages about unknown requests, from an instance that does not hold the
request, or out of phase, are stale: counted and dropped.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Iterable

import structlog

from deepinfer.protocol.messages import (
    AbortRequest,
    EncodeRequest,
    EncodeResult,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    Hello,
    KvEvents,
    KvResync,
    PrefillDone,
    PrefillJob,
    RequestFinished,
    ServiceExited,
    StreamDelta,
    TextDeltaItem,
    TextDeltas,
)
from deepinfer.services.router_admission import AdmissionMixin, Refusal
from deepinfer.services.router_cache import Chosen, Prediction, PrefillCostModel
from deepinfer.services.router_moves import MAX_HANDOFF_RETRIES, RETRIED_CODES, MovesMixin
from deepinfer.services.router_placement import DECODE, Assignment, Beat, Instance, InstanceTable, Placement
from deepinfer.services.router_resume import ResumeMixin, client_key
from deepinfer.services.router_state import (
    ClientId,
    Outbound,
    Phase,
    RouterConfig,
    RouterMetrics,
    RouterRequest,
    estimate_tokens,
    input_problem,
)

__all__ = ["ClientId", "Outbound", "Phase", "RouterConfig", "RouterCore", "RouterMetrics", "RouterRequest"]

log = structlog.get_logger("deepinfer.router")



class RouterCore(AdmissionMixin, MovesMixin, ResumeMixin):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.table = InstanceTable(config.heartbeat_timeout_s, config.progress_timeout_s, config.block_size)
        self.metrics = RouterMetrics(config.max_ttft_samples)
        self.cache = PrefillCostModel(config)  # the prefix index and measured rates: prefill placement
        self.draining = False  # set by the shell on shutdown: new requests are refused
        self.queued_requests = 0
        self.queued_tokens = 0  # estimated until encoded, then exact
        self._reqs: dict[str, RouterRequest] = {}
        self._by_client: dict[ClientId, dict[str, str]] = {}  # client → its request id → ours
        self._deadlines: list[tuple[float, str]] = []  # heap; entries of ended requests are skipped
        self._parked: dict[str, None] = {}  # encoded, waiting for a live worker (insertion-ordered)
        self._counter = 0
        self._inflight_by_tenant: Counter[str] = Counter()
        self._queued_tokens_by_tenant: Counter[str] = Counter()  # of queued requests, like queued_tokens
        self.unplaced_tokens = 0  # queued tokens of requests no worker has yet (tokenizing or parked)
        # When a worker (pair) last could take a request: for `placement_timeout_s` after, new requests are
        # admitted and wait parked for one (a restart, a rolling drain) instead of being refused.
        self._servable_at = -math.inf
        self._refusal_logged_at = -math.inf  # refused deltas are logged at most once a second
        self._init_resumes()

    @property
    def num_inflight(self) -> int:
        return len(self._reqs)

    def phase_counts(self) -> Counter[str]:
        """Requests in flight by phase (Phase values), for the metrics."""
        return Counter(st.phase.value for st in self._reqs.values())

    def request(self, request_id: str) -> RouterRequest | None:
        """By our id, as the services know it now."""
        return self._reqs.get(request_id)

    def request_of(self, client: ClientId, client_request_id: str) -> RouterRequest | None:
        """By the client's id for it (ours changes when the request moves)."""
        rid = self._by_client.get(client, {}).get(client_request_id)
        return None if rid is None else self._reqs[rid]

    # ----- client events -----

    def on_generate(self, client: ClientId, req: GenerateRequest, now: float) -> list[Outbound]:
        def refuse(code: ErrorCode, message: str, shed: str | None = None,
                   retry: float | None = None) -> list[Outbound]:
            self.metrics.rejected[code] += 1
            if shed is not None:
                self.metrics.shed[shed] += 1
            if retry is None and code in ("overloaded", "unavailable"):
                retry = self.config.retry_after_s
            return [Outbound(client, ErrorReply(req.request_id, code, message, retry))]

        cfg = self.config
        problem = input_problem(req)
        if problem is None and req.request_id in self._by_client.get(client, {}):
            problem = f"request id {req.request_id!r} is already in flight"
        if problem is not None:
            return refuse("invalid_request", problem)
        if cfg.require_api_key and req.api_key not in cfg.tenants:
            return refuse("unauthorized", "unknown or missing api_key")
        estimate, tenant = estimate_tokens(req), cfg.known_tenant(req.api_key)
        slo = cfg.ttft_slo(tenant, req.ttft_slo_s)
        admitted = self._admit(req, tenant, estimate, slo, now)
        if isinstance(admitted, Refusal):
            return refuse(admitted.code, admitted.message, admitted.shed, admitted.retry_after_s)
        st = self._open(client, req, admitted, now, now)
        st.ttft_slo_s, st.tpot_slo_s = slo, cfg.tpot_slo(tenant, req.tpot_slo_s)
        encode = EncodeRequest(st.rid, req.prompt, req.messages, req.prompt_token_ids, cache_salt=st.cache_salt,
                               stop=list(req.params.stop), max_tokens=req.params.max_tokens)
        return [Outbound(admitted.name, encode)]

    def _open(self, client: ClientId, req: GenerateRequest, tokenizer: Instance, arrival: float,
              now: float, rid: str | None = None) -> RouterRequest:
        """Admit `req` (valid, authorised, with a live tokenizer): its state, held by `tokenizer`, queued.
        `rid`: the id a worker already knows it by (a reclaimed request's, `router_resume`)."""
        cfg = self.config
        rid = rid or f"{cfg.id_prefix}{self._counter}"
        deadline = arrival + (req.timeout_s if req.timeout_s is not None else cfg.request_timeout_s)
        st = RouterRequest(rid, self._counter, client, req, arrival, deadline, Assignment(rid, tokenizer.name))
        self._counter += 1
        self._reqs[rid] = st
        self._by_client.setdefault(client, {})[req.request_id] = rid
        heapq.heappush(self._deadlines, (deadline, rid))
        st.cache_salt = cfg.tenants.get(req.api_key, cfg.default_cache_salt) if req.api_key else cfg.default_cache_salt
        st.tenant = cfg.known_tenant(req.api_key)
        st.priority = max(req.priority, cfg.priority_floor.get(st.tenant, cfg.default_priority_floor))
        self._inflight_by_tenant[st.tenant] += 1
        self._enqueue(st, estimate_tokens(req))
        self.table.hold(st.where, {tokenizer.name})
        self.metrics.admitted += 1
        return st

    def on_abort(self, client: ClientId, abort: AbortRequest, now: float) -> list[Outbound]:
        rid = self._by_client.get(client, {}).get(abort.request_id)
        if rid is None:
            self._forget_resumes(client, abort.request_id)
            return []  # unknown or already ended: a no-op, as the protocol says
        return self._cancel(self._reqs[rid], now, abort.reason or "aborted by the client")

    def on_client_gone(self, client: ClientId, now: float) -> list[Outbound]:
        self._forget_resumes(client)
        out: list[Outbound] = []
        for rid in list(self._by_client.get(client, {}).values()):
            st = self._reqs[rid]
            st.client_gone = True
            out += self._cancel(st, now, "client disconnected")
        return out

    def on_client_slow(self, client: ClientId, now: float) -> list[Outbound]:
        """The client stopped reading (its queue is full): its requests end now with an explicit error rather
        than hold blocks and batch slots for a reader that is not there."""
        out: list[Outbound] = []
        for rid in list(self._by_client.get(client, {}).values()):
            out += self._error(self._reqs[rid], "overloaded", "the client read its results too slowly", now)
        return out

    # ----- service events -----

    def on_hello(self, hello: Hello, now: float) -> list[Outbound]:
        """Registers a service (clients need no registration). The shell's handshake answers the Hello;
        an `incarnation` capability lets a restart be seen here, before its first heartbeat."""
        if hello.service == "client":
            return []
        incarnation = hello.capabilities.get("incarnation")
        beat = self.table.hello(hello.service, hello.instance, incarnation, now)
        if beat is Beat.STALE:
            return []
        out: list[Outbound] = []
        if beat is Beat.RESTARTED:
            assert incarnation is not None
            out = self._restart(hello.instance, hello.service, incarnation, now, None)
        inst = self.table.instances[hello.instance]
        inst.kvcache = hello.capabilities.get("kvcache")
        pid = hello.capabilities.get("pid", "")
        inst.pid = int(pid) if pid.isdigit() else None
        return out

    def on_service_exited(self, note: ServiceExited, now: float, cause: str | None = None) -> list[Outbound]:
        """The supervisor saw the process exit (or a draining service says it exits: `cause` "drain"): its
        requests move now, not at the heartbeat timeout. Only the process the note names (by pid) is retired:
        a note about a predecessor changes nothing."""
        inst = self.table.get(note.instance)
        if inst is None or inst.pid is None or inst.pid != note.pid or not inst.alive:
            return self._stale()
        self.table.retire(inst)
        self.cache.index.forget(inst.name)
        return self._lose(inst, f"{inst.role} {inst.name} exited with code {note.returncode}", now, tell_instance=False,
                          cause=cause)

    def on_heartbeat(self, hb: Heartbeat, now: float) -> list[Outbound]:
        beat = self.table.heartbeat(hb, now)
        if beat is Beat.STALE:
            return self._stale()
        if beat is Beat.RESTARTED:
            return self._restart(hb.instance, hb.service, hb.incarnation, now, hb)
        return self._place_parked(now)

    def _restart(self, name: str, role: str, incarnation: str, now: float, hb: Heartbeat | None) -> list[Outbound]:
        inst = self.table.instances[name]
        # Its cached blocks went with the old process (unless its new stream of KV events came first).
        self.cache.index.forget(name, unless_incarnation=incarnation)
        # The new process never had the old one's requests: nothing to tell it.
        out = self._lose(inst, f"{inst.role} {name} restarted", now, tell_instance=False,
                         reset=lambda: self.table.reset(name, role, incarnation, now, hb))
        return out + self._place_parked(now)

    def on_encode_result(self, sender: str, res: EncodeResult, now: float) -> list[Outbound]:
        st = self._reqs.get(res.request_id)
        if st is None or st.phase is not Phase.TOKENIZING or sender != st.where.tokenizer:
            return self._stale()
        st.prompt_ids, st.block_hashes = res.token_ids, res.block_hashes
        self._recharge(st, len(st.job_tokens))
        if st.resumed and len(st.output_ids) >= st.params.max_tokens:  # its client had every token
            st.finish_reason = "length"
            kept = [Outbound(st.reclaim_from, AbortRequest(st.rid, "its client had every token"))] \
                if st.reclaim_from is not None else []  # not a holder yet: the worker that kept it
            st.reclaim_from = None
            return kept + self._finish(st, now)
        if st.reclaim_from is not None:
            reclaimed = self._reclaim(st, now)
            if reclaimed is not None:
                return reclaimed
        # (A request that moved or resumed was admitted already: it is never refused for the queue it rejoined.)
        if not st.moves and not st.resumed:
            refusal = self._over_token_limits(st)
            if refusal is not None:
                self.metrics.shed[refusal[0]] += 1
                return self._error(st, "overloaded", refusal[1], now, retry_after_s=self.config.retry_after_s)
        self._set_phase(st, Phase.PARKED)
        st.parked_since = now
        self._parked[st.rid] = None
        return self._place(st, now)

    def on_prefill_done(self, done: PrefillDone, now: float) -> list[Outbound]:
        st = self._reqs.get(done.request_id)
        if st is None or st.phase not in (Phase.PREFILLING, Phase.FINISHING) or done.prefill_worker != st.where.prefill:
            return self._stale()
        st.prefill_done = st.prefill_done or done  # a moved request's usage is its first prefill's
        self.table.prefill_over(st.where)
        self.cache.observe(done)  # learn the worker's rates; then score the prefix index against what it found
        self.metrics.count_cached(st.predicted_blocks, self.config.block_size, done)
        if st.phase is Phase.FINISHING:
            self.table.hold(st.where, ())  # the prefill worker is done with it too
            return self._finish(st, now)
        self._set_phase(st, Phase.DECODING)
        self._dequeue(st)
        self.table.hold(st.where, {st.where.tokenizer, st.where.decode})
        return []

    def on_kv_events(self, sender: str, ev: KvEvents, now: float) -> list[Outbound]:
        """Feed the prefix index. Only a publisher speaks for itself; a broken stream gets one KvResync."""
        if sender != ev.publisher:
            return self._stale()
        applied = self.cache.index.apply(ev, now)
        if applied.stale:
            return self._stale()
        self.metrics.kv_events += 1
        if applied.resync is None:
            return []
        self.metrics.resyncs += 1
        return [Outbound(ev.publisher, KvResync(applied.resync))]

    def on_text_deltas(self, sender: str, deltas: TextDeltas, now: float) -> list[Outbound]:
        """Text from tokenizer `sender`. Each item counts only from the request's tokenizer, and only when
        it comes of the token batch of the worker the request was placed on (`deltas.worker`, when the
        tokenizer names it): any other worker's are refused, counted and logged."""
        out: list[Outbound] = []
        for item in deltas.items:
            st = self._reqs.get(item.request_id)
            if (
                st is None
                or st.phase not in (Phase.PREFILLING, Phase.DECODING)
                or sender != st.where.tokenizer
            ):
                out += self._stale()
            elif deltas.worker is not None and not self._from_placed_worker(deltas.worker, st, item.offset):
                self._refuse_delta(sender, deltas.worker, st, now)
            elif item.offset < len(st.output_ids):  # a duplicate
                out += self._stale()
            elif item.offset > len(st.output_ids):
                msg = f"tokenizer {st.where.tokenizer} skipped tokens {len(st.output_ids)}..{item.offset - 1}"
                out += self._error(st, "internal", msg, now)
            else:
                out += self._on_item(st, item, now)
        return out

    @staticmethod
    def _from_placed_worker(worker: str, st: RouterRequest, offset: int) -> bool:
        """The decode worker streams every token. The prefill worker streams one only when its first token
        already ends the request (EOS, a stop, max_tokens): the job's first, at the output the job resumed
        from (`job_output`: 0 unless the request moved); its batch may reach us after its PrefillDone."""
        return worker == st.where.decode or (worker == st.where.prefill and offset == st.job_output)

    def _refuse_delta(self, tokenizer: str, worker: str, st: RouterRequest, now: float) -> None:
        self.metrics.refused_deltas += 1
        if now - self._refusal_logged_at >= 1.0:
            self._refusal_logged_at = now
            log.warning("text deltas from another worker than the request's refused", tokenizer=tokenizer,
                        worker=worker, placed_on=(st.where.prefill, st.where.decode), request_id=st.rid,
                        refused=self.metrics.refused_deltas)

    def on_error(self, sender: str, err: ErrorReply, now: float) -> list[Outbound]:
        st = self._reqs.get(err.request_id)
        if st is None or sender not in st.where.holders:
            return self._stale()
        if st.phase is Phase.FINISHING:
            return self._finish(st, now)  # the output is complete already
        if sender == st.reclaim_from and st.phase is Phase.DECODING and len(st.output_ids) == st.job_output:
            return self._reclaim_refused(st, sender, err, now)
        where = st.where
        if (st.phase is Phase.PREFILLING and sender in (where.prefill, where.decode) and err.code in RETRIED_CODES
                and st.handoff_retries < MAX_HANDOFF_RETRIES):
            retried = self._retry_handoff(st, sender, err, now)
            if retried is not None:
                return retried
        return self._error(st, err.code, err.message, now, skip={sender}, retry_after_s=err.retry_after_s)

    def tick(self, now: float) -> list[Outbound]:
        """Periodic: dead instances, deadlines, parked requests."""
        out: list[Outbound] = []
        if self.table.place(1, 1, now) is not None:
            self._servable_at = now
        for inst, why in self.table.expire(now):
            self.cache.index.forget(inst.name)  # if it comes back, its events resume past a gap: resync
            out += self._lose(inst, why, now, tell_instance=True)  # it may be wedged, not gone
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            st = self._reqs.get(rid)
            if st is None:
                continue
            if st.phase is Phase.FINISHING:
                out += self._finish(st, now)
            else:
                out += self._error(st, "timeout", f"no result within {st.deadline - st.arrival:g}s", now)
        if len(self._deadlines) > 2 * len(self._reqs) + 64:  # drop entries of ended requests
            self._deadlines = [(s.deadline, s.rid) for s in self._reqs.values()]
            heapq.heapify(self._deadlines)
        return out + self._resumes_due(now) + self._place_parked(now)

    # ----- internals: placement -----

    def _place(self, st: RouterRequest, now: float) -> list[Outbound]:
        # After a failed handoff it avoids that handoff's workers, unless only they can take it now.
        chosen = (self._choose(st, now, exclude=st.avoid) if st.avoid else None) or self._choose(st, now)
        if chosen is None:
            return []
        if not st.attempts:  # its first placement: within its SLOs, or refused
            chosen = self._within_slos(st, chosen, now)
            if isinstance(chosen, Refusal):
                return self._error(st, chosen.code, chosen.message, now, retry_after_s=chosen.retry_after_s)
        return self._send_job(st, *chosen, now)

    def _choose(self, st: RouterRequest, now: float, exclude: Iterable[str] = ()) -> Chosen | None:
        return self.cache.choose(self.table, st.block_hashes, len(st.job_tokens), st.params.max_tokens, now, exclude)

    def _send_job(self, st: RouterRequest, placement: Placement, prediction: Prediction, now: float) -> list[Outbound]:
        self._parked.pop(st.rid, None)
        # Cache-aware placement charges what the worker will compute; least-loaded stays the plain baseline.
        compute = prediction.uncached_tokens if self.cache.cache_aware else None
        params = st.params
        if params.prompt_logprobs is not None and (st.prompt_logprobs is not None or st.output_ids):
            # A moved request whose prompt logprobs arrived (with its first tokens): its next worker
            # need not compute them again, and can reuse cached blocks.
            params = dataclasses.replace(params, prompt_logprobs=None)
        self.table.assign(st.where, placement, len(st.job_tokens), compute, st.block_hashes, st.tpot_slo_s)
        site = "colocated"
        if placement.decode.role == DECODE:  # a P/D pair was there to choose from (router_cache)
            site = "remote" if placement.prefill is not placement.decode else "local"
            self.metrics.prefill_sites[site] += 1
        # Every placement and its reasons, for `--log-level debug`: where, and what the prediction saw.
        log.debug("prefill placed", request_id=st.rid, site=site, prefill=placement.prefill.name,
                  decode=placement.decode.name, attempt=st.attempts + 1, cached_blocks=prediction.cached_blocks,
                  uncached_tokens=prediction.uncached_tokens, predicted_s=round(prediction.seconds, 4),
                  waited_s=round(now - st.arrival, 4), policy="cache_aware" if self.cache.cache_aware else
                  "least_loaded")
        st.predicted_blocks = prediction.blocks
        self._set_phase(st, Phase.PREFILLING)
        st.attempts, st.job_output, st.avoid = st.attempts + 1, len(st.output_ids), frozenset()
        st.job_sent_at = st.job_sent_at or now
        job = PrefillJob(
            st.rid,
            st.job_tokens,
            st.block_hashes,
            params,
            decode_worker=placement.decode.name,
            detokenizer=st.where.tokenizer,
            priority=st.priority,
            arrival_time=st.arrival,
            expected_cached_blocks=prediction.cached_blocks,
            cache_salt=st.cache_salt,
            num_output_tokens=len(st.output_ids),
            client_key=client_key(st.client, st.req.request_id),
        )
        return [Outbound(placement.prefill.name, job)]

    def _place_parked(self, now: float) -> list[Outbound]:
        out: list[Outbound] = []
        for rid in sorted(self._parked, key=lambda r: self._reqs[r].order):
            st = self._reqs[rid]
            if now - st.parked_since > self.config.placement_timeout_s:
                waited = now - st.parked_since
                out += self._error(st, "worker_lost", f"no live worker took the request for {waited:.1f}s", now)
            else:
                out += self._place(st, now)
        return out

    # ----- internals: output and endings -----

    def _on_item(self, st: RouterRequest, item: TextDeltaItem, now: float) -> list[Outbound]:
        out: list[Outbound] = []
        # Items carry the request's totals so far; the largest is the latest (a worker that does not
        # speculate, or an engine that reports them only at the end, sends zeros meanwhile).
        st.spec_proposed_tokens = max(st.spec_proposed_tokens, item.spec_proposed_tokens)
        st.spec_accepted_tokens = max(st.spec_accepted_tokens, item.spec_accepted_tokens)
        if item.token_ids or item.text:
            if st.first_token_at is None and item.token_ids:
                st.first_token_at = now
                self.metrics.ttft_s.append(now - st.arrival)
                if st.predicted_ttft_s:
                    self.metrics.ttft_over_predicted.append((now - st.arrival) / st.predicted_ttft_s)
            if item.token_ids:
                st.last_token_at = now
            st.text.append(item.text)
            st.output_ids.extend(item.token_ids)
            if item.logprobs:
                st.logprobs.extend(item.logprobs)
            if item.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = item.prompt_logprobs
            if st.req.stream:
                delta = StreamDelta(st.req.request_id, item.text, item.token_ids, item.offset, item.logprobs)
                if not st.streamed and st.params.prompt_logprobs is not None:  # the first delta: the prompt's
                    delta = dataclasses.replace(delta, prompt_token_ids=list(st.prompt_ids),
                                                prompt_logprobs=st.prompt_logprobs)
                st.streamed = True
                out.append(Outbound(st.client, delta))
        if not item.finished:
            return out
        if item.finish_reason == "error":  # the tokenizer saw a gap in the tokens and dropped the request
            lost = "tokens of this request were lost on their way to the tokenizer"
            return out + self._error(st, "internal", lost, now, skip={st.where.tokenizer})
        if item.stop_string is not None:  # the tokenizer found a stop string: the decode worker must stop
            out.append(Outbound(st.where.decode, AbortRequest(st.rid, "stop string")))
        st.finish_reason, st.stop_string = item.finish_reason or "stop", item.stop_string
        self.table.decode_over(st.where)  # (a co-located worker still holds it as the prefill worker)
        if st.phase is Phase.PREFILLING:  # PrefillDone is still on its way
            self._set_phase(st, Phase.FINISHING)
            self._dequeue(st)
            self.table.hold(st.where, {st.where.prefill})
            return out
        self.table.hold(st.where, ())  # tokenizer and decode worker are done with it
        return out + self._finish(st, now)

    def _finish(self, st: RouterRequest, now: float) -> list[Outbound]:
        if st.predicted_tpot_s and st.tpot_s is not None:
            self.metrics.tpot_over_predicted.append(st.tpot_s / st.predicted_tpot_s)
        return self._end(st, st.result(st.finish_reason or "stop", now), "finished", now, set())

    def _cancel(self, st: RouterRequest, now: float, reason: str) -> list[Outbound]:
        if st.phase is Phase.FINISHING:
            return self._finish(st, now)
        return self._end(st, st.result("abort", now), reason, now, set())

    def _error(
        self,
        st: RouterRequest,
        code: ErrorCode,
        message: str,
        now: float,
        skip: set[str] | None = None,
        retry_after_s: float | None = None,
    ) -> list[Outbound]:
        err = ErrorReply(st.req.request_id, code, message, retry_after_s)
        return self._end(st, err, f"{code}: {message}", now, skip or set())

    def _end(
        self, st: RouterRequest, terminal: RequestFinished | ErrorReply, reason: str, now: float, skip: set[str]
    ) -> list[Outbound]:
        """The one way out: aborts to the holders, the terminal message, every trace of the request gone."""
        out = [Outbound(name, AbortRequest(st.rid, reason)) for name in sorted(st.where.holders - skip)]
        self.table.hold(st.where, ())
        self._dequeue(st)
        self._parked.pop(st.rid, None)
        del self._reqs[st.rid]
        self._inflight_by_tenant[st.tenant] -= 1
        if not self._inflight_by_tenant[st.tenant]:
            del self._inflight_by_tenant[st.tenant]
        ids = self._by_client[st.client]
        del ids[st.req.request_id]
        if not ids:
            del self._by_client[st.client]
        if isinstance(terminal, RequestFinished):
            self.metrics.finished[terminal.finish_reason] += 1
            self.metrics.count_speculation(terminal.usage)
        else:
            self.metrics.errors[terminal.code] += 1
        if not st.client_gone:
            out.append(Outbound(st.client, terminal))
        return out

    def _stale(self) -> list[Outbound]:
        self.metrics.stale += 1
        return []
