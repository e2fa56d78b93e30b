"""Moving a request off what failed it: `RouterCore`'s moves (`MovesMixin`), for a lost service (its process
exited, restarted or stopped heartbeating) and for a failed prefill or KV handoff that was not a death.

A moved request continues under a new service-side id (the old one's late messages are then stale): its
tokenizer (the same one when it is alive, else another) rebuilds the detokenizer state from the output the
client has seen (`EncodeRequest.resume_output_ids`), and it is placed anew with prompt + that output, which
the worker prefills before continuing at the next output position; the client's stream goes on without a
gap or a repeat. Every move is counted by cause (`RouterMetrics.migrations`).

* A lost service's requests move, except: FINISHING ones are delivered (their output is complete), and one
  whose prefill worker is lost after its KV reached the decode worker decodes on there (`_handed_off`).
  After `max_moves` moves a request ends with `worker_lost`.
* A failed handoff (`RETRIED_CODES`) is retried once elsewhere (`_retry_handoff`): a refused reservation
  under the same id on another decode worker, anything else moved, avoiding the failed pair's workers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from deepinfer.protocol.messages import AbortRequest, EncodeRequest, ErrorReply
from deepinfer.services.router_placement import Assignment, Instance
from deepinfer.services.router_state import Outbound, Phase, RouterRequest

if TYPE_CHECKING:
    from deepinfer.services.router_placement import InstanceTable
    from deepinfer.services.router_state import ClientId, RouterConfig, RouterMetrics

# A failed prefill or KV handoff is retried (once) for these codes; the others are the request's own fault
# (invalid_request) or not a worker's to give.
RETRIED_CODES = frozenset({"overloaded", "internal", "worker_lost", "unavailable", "timeout"})
MAX_HANDOFF_RETRIES = 1
HANDOFF_FAILURE = "handoff_failure"  # the migration cause of a retried handoff


class MovesMixin:
    """The moves of `RouterCore` (module docstring). They end requests only through the core's `_error` and
    `_finish`, and keep its queue's accounting through `_set_phase`, `_enqueue` and `_dequeue`."""

    # The core's state this part uses, set by `RouterCore.__init__`.
    config: RouterConfig
    table: InstanceTable
    metrics: RouterMetrics
    _reqs: dict[str, RouterRequest]
    _by_client: dict[ClientId, dict[str, str]]
    _deadlines: list[tuple[float, str]]
    _parked: dict[str, None]

    def _retry_handoff(self, st: RouterRequest, sender: str, err: ErrorReply, now: float) -> list[Outbound] | None:
        """A prefill, or its KV handoff, failed without a death: place the request once more elsewhere. None
        when no other worker can take it (the client gets the error then)."""
        where = st.where
        if err.code == "overloaded" and sender == where.prefill:
            # The decode worker refused the reservation: no KV or token reached it, so the request keeps its
            # id and goes straight to another decode worker (the prefill worker dropped the job).
            refused = where.decode
            self.table.hold(where, {where.tokenizer})
            self._set_phase(st, Phase.PARKED)
            chosen = self._choose(st, now, exclude={refused})
            if chosen is None:
                return None
            self.metrics.retries += 1
            st.handoff_retries += 1
            self.metrics.migrations[HANDOFF_FAILURE] += 1
            return self._send_job(st, *chosen, now)
        # Anything else may have happened after the decode worker pushed the first token to the tokenizer:
        # move the request (a new id, the tokenizer resynced from what the client saw), avoiding the
        # workers of the failed handoff — both if it can, else whichever of them it can.
        if st.moves >= self.config.max_moves:
            return None
        pair = [n for n in (where.prefill, where.decode) if n is not None]
        avoid = next((frozenset(a) for a in ([*pair], pair[-1:], pair[:1])
                      if self._choose(st, now, exclude=a) is not None), None)
        if avoid is None:
            return None
        out = [Outbound(n, AbortRequest(st.rid, f"retried: {err.message}")) for n in sorted(where.holders - {sender})]
        self.table.hold(where, ())
        st.handoff_retries += 1
        st.avoid = avoid
        return out + self._move(st, f"{sender}: {err.code}: {err.message}", now, HANDOFF_FAILURE)

    def _lose(self, inst: Instance, why: str, now: float, tell_instance: bool,
              reset: Callable[[], None] | None = None, cause: str | None = None) -> list[Outbound]:
        """End or move every request `inst` held (`cause`, for the metrics: default "<its role>_death").
        `reset` (a restart: adopt the new incarnation) runs after they are off it and before the moved ones
        are placed, so a restarted tokenizer can take them."""
        out: list[Outbound] = []
        moving: list[RouterRequest] = []
        skip = set() if tell_instance else {inst.name}
        cause = cause or f"{inst.role}_death"
        for rid in sorted(inst.held):
            st = self._reqs[rid]
            if st.phase is Phase.FINISHING:
                out += self._finish(st, now)
            elif self._handed_off(st, inst.name):
                out += self._adopt(st, why, tell_instance)
            elif st.moves >= self.config.max_moves:
                out += self._error(st, "worker_lost", f"{why} (moved {st.moves} times already)", now, skip=skip)
            else:  # off every holder first: the moves may land on the same instances
                out += [Outbound(n, AbortRequest(st.rid, f"moved: {why}")) for n in sorted(st.where.holders - skip)]
                self.table.hold(st.where, ())
                self._parked.pop(st.rid, None)
                moving.append(st)
        if reset is not None:
            reset()
        for st in moving:
            out += self._move(st, why, now, cause)
        return out

    def _handed_off(self, st: RouterRequest, lost: str) -> bool:
        """Whether `lost`, the prefill worker of `st` (disaggregated), is no longer needed: its KV is installed
        on the decode worker. PrefillDone (the acknowledged handoff) may not have come; the proof is a token
        the decode worker's engine made — past the first one, which it streams before installing the KV."""
        where = st.where
        return (st.phase is Phase.PREFILLING and lost == where.prefill and where.decode not in (None, lost)
                and len(st.output_ids) >= st.job_output + 2)

    def _adopt(self, st: RouterRequest, why: str, tell_prefill: bool) -> list[Outbound]:
        """Its prefill worker is lost after the handoff: the request decodes on, as if PrefillDone had come
        (without the prefill's cache usage, which went with the worker)."""
        where = st.where
        out = [Outbound(where.prefill, AbortRequest(st.rid, why))] if tell_prefill and where.prefill else []
        self.table.hold(where, {where.tokenizer, where.decode})  # the KV in transit is installed
        self._set_phase(st, Phase.DECODING)
        self._dequeue(st)
        self.metrics.handoffs_adopted += 1
        return out

    def _move(self, st: RouterRequest, why: str, now: float, cause: str) -> list[Outbound]:
        """Continue `st`, held by no one now, under a new id (see the module docstring): its tokenizer if it
        is alive (a restarted one is), else another live one. `cause` names why, for the metrics."""
        tokenizer = self.table.get(st.where.tokenizer)
        if tokenizer is None or not tokenizer.alive:
            tokenizer = self.table.pick_tokenizer(now)
        if tokenizer is None:
            return self._error(st, "worker_lost", f"{why} (no live tokenizer to continue it)", now)
        del self._reqs[st.rid]
        st.moves += 1
        self.metrics.moves += 1
        self.metrics.migrations[cause] += 1
        st.rid = f"{st.rid.split('~')[0]}~{st.moves}"
        self._reqs[st.rid] = st
        self._by_client[st.client][st.req.request_id] = st.rid
        heapq.heappush(self._deadlines, (st.deadline, st.rid))
        st.where = Assignment(st.rid, tokenizer.name)
        self.table.hold(st.where, {tokenizer.name})
        self._set_phase(st, Phase.TOKENIZING)
        if not st.queued:  # it waits for a worker again
            self._enqueue(st, len(st.job_tokens))
        req, stop, budget = st.req, list(st.req.params.stop), st.req.params.max_tokens
        if st.prompt_ids:
            encode = EncodeRequest(st.rid, prompt_token_ids=st.prompt_ids, cache_salt=st.cache_salt, stop=stop,
                                   resume_output_ids=list(st.output_ids), max_tokens=budget)
        else:  # its encoding was lost with the tokenizer: start that over
            encode = EncodeRequest(st.rid, req.prompt, req.messages, req.prompt_token_ids, st.cache_salt, stop,
                                   max_tokens=budget)
        return [Outbound(tokenizer.name, encode)]
