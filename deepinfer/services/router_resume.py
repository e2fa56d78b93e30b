"""Resuming a request whose client lost its connection to the router (`ResumeRequest`): `RouterCore`'s
`ResumeMixin`. The client keeps what it received of each generation and, on its next connection, asks the
router there to go on from it; two cases, told apart by whether this router holds the request:

* It does (the connection dropped and came back; the router did not restart): `Resumed`, then one
  StreamDelta with everything past what the client said it had, and the request goes on. A client whose
  output is not a prefix of the request's gets `invalid_request` and the request ends.
* It does not (this router succeeded the one that held it, whose services dropped it when they met this
  one; or the request ended and its last message was lost with the connection): it is admitted again as it
  was — tenant and cache salt from its api_key, priority, its deadline counted from when the client first
  sent it — and continues from the client's output as a moved request does (`router_moves`): the tokenizer
  rebuilds its detokenizer state from that output (`EncodeRequest.resume_output_ids`), a worker prefills
  prompt + output (mostly cached) and goes on at the next position, so greedy and seeded output are an
  undisturbed run's. It skips the queue's limits and the TTFT SLO (it was admitted once), but needs a live
  tokenizer: a restarted router meets its services only as they say Hello again, so it waits for one up to
  `placement_timeout_s` (then `unavailable`). One whose client already has `max_tokens` tokens ends with
  finish_reason "length" once encoded. Counted: `resumes` by case, and a readmission as a migration with
  cause "router_lost".

Not covered: a request the client had every token of but whose end it never saw for another reason than
length (a stop token or stop string) is continued past that end by a successor router.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from deepinfer.protocol.messages import EncodeRequest, ErrorReply, Resumed, ResumeRequest, StreamDelta
from deepinfer.services.router_state import Outbound, RouterRequest, input_problem

if TYPE_CHECKING:
    from deepinfer.services.router_placement import InstanceTable
    from deepinfer.services.router_state import ClientId, RouterConfig, RouterMetrics

READMITTED = "router_lost"  # the migration cause of a readmitted request


class ResumeMixin:
    """The resumes of `RouterCore` (module docstring). A readmitted request is opened with the core's `_open`
    (as `on_generate` opens one), found with its `request_of`, and ends through its `_error`/`_end`."""

    config: RouterConfig
    table: InstanceTable
    metrics: RouterMetrics
    draining: bool

    def _init_resumes(self) -> None:
        # Resumes waiting for a live tokenizer, by client and its request id, with when they came.
        self._resumes_waiting: dict[tuple[ClientId, str], tuple[ResumeRequest, float]] = {}

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

    def _readmit(self, client: ClientId, resume: ResumeRequest, now: float) -> list[Outbound]:
        req = resume.request

        def refuse(code: str, message: str) -> list[Outbound]:
            self.metrics.resumes["refused"] += 1
            return [Outbound(client, ErrorReply(req.request_id, code, message))]  # type: ignore[arg-type]

        if self.config.require_api_key and req.api_key not in self.config.tenants:
            return refuse("unauthorized", "unknown or missing api_key")
        if self.draining:
            return refuse("overloaded", "the router is shutting down")
        tokenizer = self.table.pick_tokenizer(now)
        if tokenizer is None:  # a restarted router whose services have not said Hello yet
            self._resumes_waiting[(client, req.request_id)] = (resume, now)
            return []
        st = self._open(client, req, tokenizer, now - min(max(0.0, resume.elapsed_s), 1e9), now)
        st.resumed, st.ttft_slo_s = True, None
        st.output_ids, st.text = list(resume.output_token_ids), [resume.text] if resume.text else []
        st.logprobs = list(resume.logprobs or ())
        st.prompt_logprobs, st.streamed = resume.prompt_logprobs, resume.streamed
        if st.output_ids:
            st.first_token_at = now  # its first token came before: no TTFT sample from this router
        self.metrics.resumes["readmitted"] += 1
        self.metrics.migrations[READMITTED] += 1
        stop, budget = list(req.params.stop), req.params.max_tokens
        encode = EncodeRequest(st.rid, req.prompt, req.messages, req.prompt_token_ids, st.cache_salt, stop,
                               resume_output_ids=list(st.output_ids), max_tokens=budget)
        return [Outbound(client, Resumed(req.request_id, len(st.output_ids))), Outbound(tokenizer.name, encode)]

    def _resumes_due(self, now: float) -> list[Outbound]:
        """Readmit the waiting resumes once a tokenizer is live; refuse those that waited too long."""
        out: list[Outbound] = []
        for key, (resume, since) in list(self._resumes_waiting.items()):
            if self.table.pick_tokenizer(now) is not None:
                del self._resumes_waiting[key]
                out += self._readmit(key[0], resume, now)
            elif now - since > self.config.placement_timeout_s:
                del self._resumes_waiting[key]
                self.metrics.resumes["refused"] += 1
                out.append(Outbound(key[0], ErrorReply(resume.request_id, "unavailable",
                                                       f"no live tokenizer for {now - since:.1f}s")))
        return out

    def _forget_resumes(self, client: ClientId, request_id: str | None = None) -> None:
        """The client aborted a waiting resume (or is gone: all of its)."""
        for key in [k for k in self._resumes_waiting if k[0] == client and request_id in (None, k[1])]:
            del self._resumes_waiting[key]
