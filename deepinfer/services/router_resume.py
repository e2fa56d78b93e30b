"""Resuming a request whose client lost its connection to the router (`ResumeRequest`): `RouterCore`'s
`ResumeMixin`. The client keeps what it received of each generation and, on its next connection, asks the
router there to go on from it; three cases:

* This router holds the request (the connection dropped and came back; the router did not restart):
  `Resumed`, then one StreamDelta with everything past what the client said it had, and the request goes
  on. A client whose output is not a prefix of the request's gets `invalid_request` and the request ends.
* This router succeeded the one that held it, and the request's worker kept it running (reclaimed): a
  worker that meets a restarted router keeps every request it was decoding whose client can resume it
  (see `WorkerCore.on_router_restart`), holds back their output, and reports them (`HeldRequests`) once
  this router accepts its Hello. The resumed request is admitted under the id that worker knows
  (`client_key` ties the two: the client's identity and its request id), encoded so the tokenizer's
  detokenizer starts from the client's output, and sent back with `Reclaim`: the worker checks the
  client's output begins its own sequence, streams the tokens the client lacks (those it made while no
  router was there included) and goes on. Nothing is computed again. If it refuses (the request ended in
  error meanwhile, or its hold ran out) before any new token, the request is computed again as below.
  A router younger than `RECLAIM_WAIT_S` waits for the workers' reports before it decides a resume is
  held by no one; a held request no client claims within `UNCLAIMED_S` is aborted on its worker.
* No one holds it (its worker was lost too, or it was prefilling, or asked for logprobs, which a worker
  does not keep; or the request ended and its last message was lost with the connection): it is admitted
  again as it was — tenant and cache salt from its api_key, priority, its deadline counted from when the
  client first sent it — and continues from the client's output as a moved request does
  (`router_moves`): the tokenizer rebuilds its detokenizer state from that output
  (`EncodeRequest.resume_output_ids`), a worker prefills prompt + output (mostly cached) and goes on at
  the next position, so greedy and seeded output are an undisturbed run's.

Either way a resumed request skips the queue's limits and the TTFT SLO (it was admitted once), but needs a
live tokenizer: a restarted router meets its services only as they say Hello again, so it waits for one
up to `placement_timeout_s` (then `unavailable`). One whose client already has `max_tokens` tokens ends
with finish_reason "length" once encoded. Counted: `resumes` by case ("attached", "reclaimed",
"readmitted", "refused", "reclaim_refused"), and a request computed again as a migration with cause
"router_lost".

Not covered: a request the client had every token of but whose end it never saw for another reason than
length (a stop token or stop string) is continued past that end by a successor router when its worker did
not keep it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from deepinfer.protocol.messages import (
    AbortRequest,
    EncodeRequest,
    ErrorReply,
    HeldRequests,
    Reclaim,
    Resumed,
    ResumeRequest,
    StreamDelta,
)
from deepinfer.services.router_placement import Placement
from deepinfer.services.router_state import Outbound, Phase, RouterRequest, input_problem

if TYPE_CHECKING:
    from deepinfer.services.router_placement import InstanceTable
    from deepinfer.services.router_state import ClientId, RouterConfig, RouterMetrics

READMITTED = "router_lost"  # the migration cause of a readmitted request
# Services beat every 0.5 s (Service.heartbeat_s): a worker meets a restarted router within one beat and
# reports what it held one Hello round trip later. Resumes wait this long from the bind for those reports
# (a loaded host's slow loops included); only a resume no worker kept pays the wait.
RECLAIM_WAIT_S = 3.0
UNCLAIMED_S = 30.0  # the client's own resume window (client_session.RESUME_WITHIN_S): none comes later


def client_key(client: ClientId, request_id: str) -> str:
    """A request's name that outlives the router: its client's identity and the client's id for it."""
    return f"{client.hex()}/{request_id}"


@dataclasses.dataclass(frozen=True)
class Held:
    """A request a worker kept through a router restart (`HeldRequests`), until a client claims it."""

    worker: str
    incarnation: str
    request_id: str
    since: float


class ResumeMixin:
    """The resumes of `RouterCore` (module docstring). A readmitted request is opened with the core's `_open`
    (as `on_generate` opens one), found with its `request_of`, and ends through its `_error`/`_end`."""

    config: RouterConfig
    table: InstanceTable
    metrics: RouterMetrics
    draining: bool
    # The core's, used here: `request_of`, `_open`, `_error`, `_set_phase`, `_dequeue`, `_move`.

    _reqs: dict[str, RouterRequest]

    def _init_resumes(self) -> None:
        # Resumes waiting for a live tokenizer (or the workers' reports), by client and its request id, with
        # when they came.
        self._resumes_waiting: dict[tuple[ClientId, str], tuple[ResumeRequest, float]] = {}
        self._held: dict[str, Held] = {}  # by client_key
        self.started_at = -math.inf  # when this router began to serve (set by the shell once bound)

    def on_resume(self, client: ClientId, resume: ResumeRequest, now: float) -> list[Outbound]:
        req = resume.request
        problem = input_problem(req)
        if resume.request_id != req.request_id:
            problem = "a ResumeRequest's request_id must be its request's"
        elif not math.isfinite(resume.elapsed_s):
            problem = "elapsed_s must be a finite number"
        if problem is not None:
            self.metrics.resumes["refused"] += 1
            return [Outbound(client, ErrorReply(resume.request_id, "invalid_request", problem))]
        st = self.request_of(client, req.request_id)
        if st is not None:
            return self._attach(st, resume, now)
        self._resumes_waiting.pop((client, req.request_id), None)
        return self._readmit(client, resume, now)

    def _attach(self, st: RouterRequest, resume: ResumeRequest, now: float) -> list[Outbound]:
        """The client's connection came back to the router that holds `st`: send what it missed."""
        n, text = len(resume.output_token_ids), "".join(st.text)
        if st.output_ids[:n] != resume.output_token_ids or not text.startswith(resume.text):
            self.metrics.resumes["refused"] += 1
            return self._error(st, "invalid_request", "the resumed output is not this request's", now)
        self.metrics.resumes["attached"] += 1
        out = [Outbound(st.client, Resumed(st.req.request_id, n))]
        if st.req.stream and (len(st.output_ids) > n or len(text) > len(resume.text)):
            delta = StreamDelta(st.req.request_id, text[len(resume.text):], st.output_ids[n:], n,
                                st.logprobs[n:] if st.logprobs else None)
            if not resume.streamed and st.params.prompt_logprobs is not None:
                delta = dataclasses.replace(delta, prompt_token_ids=list(st.prompt_ids),
                                            prompt_logprobs=st.prompt_logprobs)
            out.append(Outbound(st.client, delta))
        return out

    def _readmit(self, client: ClientId, resume: ResumeRequest, now: float,
                 since: float | None = None) -> list[Outbound]:
        req = resume.request
        since = now if since is None else since

        def refuse(code: str, message: str) -> list[Outbound]:
            self.metrics.resumes["refused"] += 1
            return [Outbound(client, ErrorReply(req.request_id, code, message))]  # type: ignore[arg-type]

        if self.config.require_api_key and req.api_key not in self.config.tenants:
            return refuse("unauthorized", "unknown or missing api_key")
        if self.draining:
            return refuse("overloaded", "the router is shutting down")
        tokenizer = self.table.pick_tokenizer(now)
        held = self._claim(client_key(client, req.request_id)) if tokenizer is not None else None
        if tokenizer is None or (held is None and now < self.started_at + RECLAIM_WAIT_S):
            # A restarted router whose services have not said Hello (or reported what they held) yet.
            self._resumes_waiting[(client, req.request_id)] = (resume, since)
            return []
        st = self._open(client, req, tokenizer, now - min(max(0.0, resume.elapsed_s), 1e9), now,
                        rid=held.request_id if held is not None else None)
        st.resumed, st.ttft_slo_s = True, None
        st.output_ids, st.text = list(resume.output_token_ids), [resume.text] if resume.text else []
        st.logprobs = list(resume.logprobs or ())
        st.prompt_logprobs, st.streamed = resume.prompt_logprobs, resume.streamed
        if st.output_ids:
            st.first_token_at = now  # its first token came before: no TTFT sample from this router
        if held is not None:
            st.reclaim_from = held.worker
            self.metrics.resumes["reclaimed"] += 1
        else:
            self.metrics.resumes["readmitted"] += 1
            self.metrics.migrations[READMITTED] += 1
        stop, budget = list(req.params.stop), req.params.max_tokens
        encode = EncodeRequest(st.rid, req.prompt, req.messages, req.prompt_token_ids, st.cache_salt, stop,
                               resume_output_ids=list(st.output_ids), max_tokens=budget)
        return [Outbound(client, Resumed(req.request_id, len(st.output_ids))), Outbound(tokenizer.name, encode)]

    def _resumes_due(self, now: float) -> list[Outbound]:
        """Readmit the waiting resumes once they can be (`_readmit` parks them again otherwise); refuse those
        that waited too long; abort held requests no client claimed."""
        out: list[Outbound] = []
        for key, (resume, since) in list(self._resumes_waiting.items()):
            del self._resumes_waiting[key]
            if now - since <= self.config.placement_timeout_s:
                out += self._readmit(key[0], resume, now, since)
            else:
                self.metrics.resumes["refused"] += 1
                out.append(Outbound(key[0], ErrorReply(resume.request_id, "unavailable",
                                                       f"no live tokenizer for {now - since:.1f}s")))
        for key, held in list(self._held.items()):
            if now - held.since > UNCLAIMED_S:
                del self._held[key]
                out.append(Outbound(held.worker, AbortRequest(held.request_id, "no client resumed it")))
        return out

    # -- requests the workers kept through a router restart ----------------------------------------------

    def on_held(self, sender: str, msg: HeldRequests, now: float) -> list[Outbound]:
        """A worker's report of what it kept. One whose client already resumed it here (computed again: the
        report came late) is aborted there; one this router reclaimed already is its own."""
        inst = self.table.get(sender)
        if inst is None or not inst.alive or inst.incarnation != msg.incarnation:
            self.metrics.stale += 1
            return []
        out: list[Outbound] = []
        for h in msg.requests:
            if h.request_id in self._reqs:
                continue
            client, _, request_id = h.client_key.partition("/")
            try:
                resumed = self.request_of(bytes.fromhex(client), request_id)
            except ValueError:
                resumed = None
            if resumed is not None:
                out.append(Outbound(sender, AbortRequest(h.request_id, "its client resumed it elsewhere")))
            else:
                self._held[h.client_key] = Held(sender, msg.incarnation, h.request_id, now)
        return out

    def _claim(self, key: str) -> Held | None:
        held = self._held.pop(key, None)
        if held is None:
            return None
        inst = self.table.get(held.worker)
        if inst is None or not inst.alive or inst.incarnation != held.incarnation or held.request_id in self._reqs:
            return None  # its worker restarted or was lost: what it held is gone
        return held

    def _reclaim(self, st: RouterRequest, now: float) -> list[Outbound] | None:
        """`st`, reclaimed and now encoded, goes back to its worker; None: that worker is gone meanwhile,
        and `st` is placed as any readmitted request."""
        name = st.reclaim_from
        assert name is not None
        inst = self.table.get(name)
        if inst is None or not inst.alive:
            st.reclaim_from = None
            self.metrics.migrations[READMITTED] += 1
            return None
        self.table.assign(st.where, Placement(inst, inst), len(st.job_tokens), 0)
        self.table.prefill_over(st.where)  # it decodes there: nothing to prefill, its KV is there
        self._set_phase(st, Phase.DECODING)
        self._dequeue(st)
        st.attempts, st.job_output = st.attempts + 1, len(st.output_ids)
        st.job_sent_at = st.job_sent_at or now
        return [Outbound(name, Reclaim(st.rid, st.where.tokenizer, st.job_tokens, len(st.output_ids)))]

    def _reclaim_refused(self, st: RouterRequest, sender: str, err: ErrorReply, now: float) -> list[Outbound]:
        """Its worker no longer had it (or not as the client does): compute it again, as a readmission."""
        self.metrics.resumes["reclaim_refused"] += 1
        st.reclaim_from = None
        out = [Outbound(n, AbortRequest(st.rid, "reclaim refused")) for n in sorted(st.where.holders - {sender})]
        self.table.hold(st.where, ())
        return out + self._move(st, f"{sender}: {err.message}", now, READMITTED)

    def _forget_resumes(self, client: ClientId, request_id: str | None = None) -> None:
        """The client aborted a waiting resume (or is gone: all of its)."""
        for key in [k for k in self._resumes_waiting if k[0] == client and request_id in (None, k[1])]:
            del self._resumes_waiting[key]
