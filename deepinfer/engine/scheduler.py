"""The scheduler: computed tokens catch up with target tokens under a token budget.

Each request has `num_tokens` (prompt + generated so far) and `num_computed_tokens` (tokens whose KV
is in the cache). A step gives each scheduled request a chunk of `num_new_tokens` to compute; when a
request's computed count reaches its target, the step's logits for its last token are sampled and
the new token raises the target by one. Prefill, chunked prefill, decode and recompute after
preemption are all this one rule.

Policy:
* running requests first, in (priority, arrival) order, then waiting ones in the same order;
* the step's token budget is `max_num_batched_tokens`; a prompt that does not fit is chunked;
* when a running request needs a block and none is free, the lowest-priority, latest running request
  is preempted: its blocks are freed and it returns to the waiting queue to recompute (its generated
  tokens are kept and recomputed as part of its prompt);
* a waiting request is admitted only if its first chunk's blocks are free (admission never preempts),
  and not at all in a step that preempted.

The scheduler owns queues and block ids, nothing else: no tensors, no model, no sockets.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from deepinfer.cache.block_pool import BlockPool
from deepinfer.engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        """Position of the chunk's first token."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk completes the request's tokens, so its last logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Both lists stay sorted by Request.sort_key(), so their heads are served first and the tail
        # of `running` is the first to be preempted.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request wherever it is and free its blocks. Idempotent."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, req.num_computed_tokens + n, out):
                break  # req itself was preempted: nothing after it is left to run
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
            i += 1

        # After a preemption memory is short: admitting new work would only thrash.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._blocks_for(req.num_computed_tokens + n) - len(req.block_ids)
            if need > self.pool.num_free:
                break
            req.block_ids.extend(self.pool.allocate(need))
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=Request.sort_key)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Record that the model computed every scheduled chunk (call before appending sampled tokens)."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens

    # -- helpers ----------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reserve(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `req` blocks for `num_tokens`, preempting from the tail of `running` as needed.
        Returns False if `req` itself had to be preempted."""
        need = self._blocks_for(num_tokens) - len(req.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def _release_blocks(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
