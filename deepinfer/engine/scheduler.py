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
* a waiting request is admitted only if its first chunk's blocks are free, and not at all in a step where
  running requests' growth preempted;
* priority classes: a waiting request of a higher class (lower `priority`) than some running ones, whose
  first chunk's blocks or seat are not free, takes them from the running requests of lower classes, lowest
  class and latest first, at the start of the step — but only where preempting all of those would make room
  (never preempt for nothing), and never for a request of the same class (within a class, arrival order
  rules and nothing is preempted to admit). A preempted request's full blocks stay named in the pool until
  reused, so it takes them back as a prefix hit when it is admitted again: what it recomputes is only what
  was reused meanwhile;
* swap or recompute (with a `SwapPolicy`, preemption.py): a victim the policy swaps has its computed blocks
  listed in `swap_out` (the engine copies them to host memory before the step's forward, so before any of them
  is reused) and keeps `swapped_tokens`. At re-admission it takes its cached prefix as any request does, and
  the blocks of its copy past that prefix come back through `swap_in` (copied after every `swap_out` of the
  step) instead of being recomputed; its space is released then, or when it ends while swapped out.

Prefix caching (when enabled, for requests that carry a hash chain):
* admission without blocks (first admission, or re-admission after preemption) first takes the
  longest cached prefix of the request's full blocks from the pool, sharing them (ref +1), and
  starts computing after it. The hit stops short of the last token, whose logits must be computed:
  at most (num_tokens - 1) // block_size blocks. If the rest of the first chunk's blocks are not
  free, nothing is taken and the request keeps waiting. A request still collecting prompt logprobs takes
  no hit (a cached block has KV, not logits): it computes its whole prompt;
* after each step (`update`), every block that just became full of computed KV — prompt or output —
  is named in the pool by its hash, so a later prompt (or this request, after a preemption) finds it.
* a prefix is computed once even while it is being computed: a waiting request whose next block to compute
  is one a running request is still computing (the same chained hash: the same prefix) is passed over, and
  the next waiting request considered; once the block is named, it is a hit. A request is only passed over
  for a running one, which makes progress every step, so none waits forever.
  A block is only ever written while unnamed: hit blocks lie wholly before the first computed token.

Prefill/decode handoff adds two doors that bypass the waiting queue:
* `hold` takes a prefill-only request that has sampled its first token out of the queues, keeping
  its blocks (it is no longer scheduled, so it can never be preempted and its KV stays put) until
  `release`;
* `add_running` puts a request whose KV arrived from elsewhere straight into `running`. Its
  admission was the caller's block reservation, so neither `max_num_seqs` nor the token budget is
  checked: `running` may briefly exceed `max_num_seqs`, and waiting requests are then not admitted
  until it drops back below.

Speculative decoding adds draft rows to decode steps, and splits "computed" from "committed":
* a running request in its decode phase (one token to compute) that asks for `num_spec_tokens` drafts
  gets a chunk of 1 + k tokens (`ScheduledChunk.num_spec = k`) — but only if the drafts' blocks and
  budget are free without preempting anyone: speculation is optional, so it shrinks or drops first;
* after the step the engine says how many of the chunk's tokens produced KV that stays
  (`num_rejected` = the rejected drafts' positions, and any cut by a stop); `update` advances
  `num_computed_tokens` by the rest only, returns the blocks that were allocated for the rejected
  positions, and names only blocks full of committed tokens. A rejected draft's KV lies at or past
  `num_computed_tokens`, in slots the next step overwrites, in a block no one else shares.

The scheduler owns queues and block ids, nothing else: no tensors, no model, no sockets.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from deepinfer.cache.block_pool import BlockPool
from deepinfer.cache.hashing import BlockHash
from deepinfer.engine.preemption import SWAP, Decision, SwapPolicy
from deepinfer.engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # draft tokens included
    # Draft tokens among num_new_tokens (the chunk's last ones); their ids, filled in by the engine.
    num_spec: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # A draft tree's parents (speculative/tree.py), None for a chain.
    draft_parents: list[int] | None = None
    # Set by the engine before `update`: trailing tokens of the chunk whose KV is not kept.
    num_rejected: int = 0
    # len(request.block_ids) before this step allocated for it (a rollback never goes below it).
    blocks_before: int = 0

    @property
    def start(self) -> int:
        """Position of the chunk's first token."""
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk completes the request's tokens, so its last logits (all 1 + num_spec
        of them for a speculating chunk) are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens - self.num_spec == self.request.num_tokens


@dataclass(frozen=True)
class SwapOut:
    """Copy `block_ids` (the request's blocks holding its `swapped_tokens` computed tokens) to host memory."""

    request: Request
    block_ids: list[int]


@dataclass(frozen=True)
class SwapIn:
    """Copy blocks `first_block`.. of the request's host copy into `block_ids` (none: the cached prefix covered
    the copy), then drop the copy."""

    request: Request
    block_ids: list[int]
    first_block: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Swaps the engine carries out before the forward, every swap_out before any swap_in (see the policy above).
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    preempt_decisions: list[Decision] = field(default_factory=list)  # one per preempted request, with a policy
    # Prefix-cache lookups of the requests admitted this step: how many, their tokens, the tokens hit.
    prefix_lookups: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Waiting requests passed over this step because a running one was computing their next block.
    prefix_waits: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


# A request collecting prompt logprobs has logits at every position of its chunks ([chunk, vocab] floats: 400 MB
# for a 2,048-token chunk of a 49k vocabulary); its chunks are kept this short to bound that.
PROMPT_LOGPROBS_CHUNK = 512


def _chunk_cap(req: Request) -> int:
    return PROMPT_LOGPROBS_CHUNK if req.wants_prompt_logprobs else 1 << 62


class Scheduler:
    def __init__(
        self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        enable_prefix_caching: bool = True, swap: SwapPolicy | None = None,
    ) -> None:
        self.pool = pool
        self.swap = swap  # None: every victim recomputes
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        # Both lists stay sorted by Request.sort_key(), so their heads are served first and the tail
        # of `running` is the first to be preempted.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Unfinished requests (waiting or running), by id.
        self.requests: dict[str, Request] = {}
        # Held requests, by id: not unfinished (nothing left to compute) but owning blocks; their ids
        # stay in use until released.
        self.held: dict[str, Request] = {}

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._check_new_id(request.request_id)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def add_running(self, request: Request) -> None:
        """Admit a request whose first `num_computed_tokens` tokens' KV is already in its
        `block_ids` (copied in from a prefill engine) directly into `running`; its next chunk is
        computed in the next step. Blocks beyond those the computed tokens need stay with it and are
        used as it grows. Bypasses `max_num_seqs` (see the module docstring)."""
        self._check_new_id(request.request_id)
        if not 0 < request.num_computed_tokens < request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_computed_tokens} of {request.num_tokens} "
                "tokens computed; add_running needs some computed and at least one still to compute"
            )
        if len(request.block_ids) < self._blocks_for(request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_ids)} blocks for "
                f"{request.num_computed_tokens} computed tokens"
            )
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        bisect.insort(self.running, request, key=Request.sort_key)
        self._register_full_blocks(request)

    def hold(self, request: Request) -> None:
        """Take a running request that has nothing left to compute this step (its tokens all have
        KV but the last sampled one) out of the queues, keeping its blocks until `release`."""
        if request.status != RequestStatus.RUNNING:
            raise ValueError(f"only a running request can be held; {request.request_id!r} is {request.status.value}")
        self.running.remove(request)
        del self.requests[request.request_id]
        request.status = RequestStatus.HELD
        self.held[request.request_id] = request

    def release(self, request_id: str) -> Request | None:
        """Free a held request's blocks; it becomes FINISHED (finish_reason None: handed off).
        Returns None, changing nothing, if `request_id` is not held."""
        request = self.held.pop(request_id, None)
        if request is None:
            return None
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request wherever it is (held included) and free its blocks. Idempotent."""
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.HELD:
            del self.held[request.request_id]
        else:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            del self.requests[request.request_id]
        self.drop_swap(request)
        self._release_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._reclaim_for_higher_class(out)
        reclaimed = len(out.preempted)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, _chunk_cap(req))
            before = len(req.block_ids)
            spec = min(req.num_spec_tokens, budget - n) if req.num_tokens - req.num_computed_tokens == 1 else 0
            # Drafts only take blocks that are free now: never preempt for a guess.
            if spec > 0 and self._blocks_for(req.num_computed_tokens + n + spec) - before > self.pool.num_free:
                spec = 0
            if not self._reserve(req, req.num_computed_tokens + n + spec, out):
                break  # req itself was preempted: nothing after it is left to run
            out.chunks.append(ScheduledChunk(req, n + spec, num_spec=spec, blocks_before=before))
            budget -= n + spec
            i += 1

        # After running requests' growth preempted, memory is short: admitting new work would only thrash.
        computing = self._computing_now() if self.enable_prefix_caching else set()
        j = 0
        while (len(out.preempted) == reclaimed and j < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[j]
            hit = self._cached_prefix(req)
            if self._next_block_computing(req, len(hit), computing):
                out.prefix_waits += 1
                j += 1
                continue
            n, need = self._first_chunk(req, len(hit), budget)
            # Hit blocks that are free now stop being free once taken.
            if need + sum(self.pool.ref_cnt(b) == 0 for b in hit) > self.pool.num_free:
                break
            if self._caches(req) and not req.block_ids:
                self._take_hit(req, hit, out)
            before = len(req.block_ids)
            req.block_ids.extend(self.pool.allocate(need))
            if req.swapped_tokens:
                self._swap_in(req, len(hit), out)
            self.waiting.pop(j)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=Request.sort_key)
            out.chunks.append(ScheduledChunk(req, n, blocks_before=before))
            budget -= n
            computing.update(self._blocks_to_compute(req))
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Record what the step computed and kept: each chunk's tokens but its `num_rejected` last ones
        (call after appending the committed tokens, before finishing any request). Blocks allocated
        only for rejected positions go back to the pool; blocks now full of committed KV are named."""
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_new_tokens - chunk.num_rejected
            if chunk.num_rejected:
                keep = max(chunk.blocks_before, self._blocks_for(req.num_tokens))
                if len(req.block_ids) > keep:
                    self.pool.free(reversed(req.block_ids[keep:]))
                    del req.block_ids[keep:]
            self._register_full_blocks(req)

    def _reclaim_for_higher_class(self, out: SchedulerOutput) -> None:
        """Preempt running requests of lower classes than the head of `waiting` until its first chunk's blocks
        and a seat are free (see the module's policy); nothing if that cannot make room."""
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        victims = [r for r in reversed(self.running) if r.priority > head.priority]  # lowest class, latest first
        if not victims:
            return
        hit = self._cached_prefix(head)
        if self._next_block_computing(head, len(hit), self._computing_now() if self.enable_prefix_caching else set()):
            return  # it waits for a prefix a running request computes, not for memory
        _, need = self._first_chunk(head, len(hit), self.max_num_batched_tokens)

        def short() -> bool:  # as admission judges it: hit blocks that are free now count as taken
            free_hits = sum(self.pool.ref_cnt(b) == 0 for b in hit)
            return need + free_hits > self.pool.num_free or len(self.running) >= self.max_num_seqs

        if not short():
            return
        # Blocks only victims hold come free with them; a hit block among them is then free but taken.
        only_victims = {b for v in victims for b in v.block_ids if self.pool.ref_cnt(b) == 1}
        free_hits_after = sum(self.pool.ref_cnt(b) == 0 or b in only_victims for b in hit)
        if need + free_hits_after > self.pool.num_free + len(only_victims):
            return  # even every lower-class request's blocks would not do: keep them running
        for victim in victims:
            if not short():
                break
            self._preempt(victim, out)

    def _first_chunk(self, req: Request, num_hit: int, budget: int) -> tuple[int, int]:
        """A waiting request's first chunk within `budget` tokens after its `num_hit` cached blocks: its tokens,
        and the blocks its admission allocates beyond the cached ones."""
        computed = max(req.num_computed_tokens + num_hit * self.block_size, req.swapped_tokens)
        n = min(req.num_tokens - computed, budget, _chunk_cap(req))
        return n, self._blocks_for(computed + n) - len(req.block_ids) - num_hit

    # -- prefix cache -----------------------------------------------------------------------

    def _caches(self, req: Request) -> bool:
        return self.enable_prefix_caching and req.hasher is not None

    def _cached_prefix(self, req: Request) -> list[int]:
        """The pool's blocks for the longest cached prefix of an unadmitted request, never covering
        its last token. Empty for a request that already holds blocks, and for one still collecting prompt
        logprobs: a cached block has the prefix's KV but not its logits, so such a request computes its whole
        prompt (its full blocks are still named and cached for others). Takes nothing."""
        if not self._caches(req) or req.block_ids or req.wants_prompt_logprobs:
            return []
        cap = (req.num_tokens - 1) // self.block_size
        return self.pool.lookup(req.block_hashes(cap)) if cap else []

    def _take_hit(self, req: Request, hit: list[int], out: SchedulerOutput) -> None:
        """Share the hit blocks with `req` and start its computation after them. On first admission
        the hit is the request's cached prefix, counted by the tier each block was imported from; a
        block counts as "device" once it has served one hit."""
        tokens = len(hit) * self.block_size
        if req.status == RequestStatus.WAITING:
            req.num_cached_tokens = tokens
            req.cached_by_tier = {}
            for b in hit:
                tier = self.pool.origin(b) or "device"
                req.cached_by_tier[tier] = req.cached_by_tier.get(tier, 0) + self.block_size
        for b in hit:
            self.pool.clear_origin(b)
        self.pool.acquire(hit)
        req.block_ids = list(hit)
        req.num_computed_tokens = tokens
        req.num_registered_blocks = len(hit)
        out.prefix_lookups += 1
        out.prefix_query_tokens += req.num_tokens
        out.prefix_hit_tokens += tokens

    def _blocks_to_compute(self, req: Request) -> list[BlockHash]:
        """The hashes of the full blocks a running request is still to compute and name: those of its prompt
        (and any output it recomputes) past the ones named. None for a request in its decode phase."""
        if not self._caches(req) or req.num_tokens - req.num_computed_tokens <= 1:
            return []
        full = req.num_tokens // self.block_size
        return req.block_hashes(full)[req.num_registered_blocks:] if full > req.num_registered_blocks else []

    def _computing_now(self) -> set[BlockHash]:
        return {h for req in self.running for h in self._blocks_to_compute(req)}

    def _next_block_computing(self, req: Request, num_hit: int, computing: set[BlockHash]) -> bool:
        """Whether the first block `req` would compute (after its `num_hit` cached ones) is being computed by
        a running request. Only for a request that would take a hit (see `_cached_prefix`)."""
        if not computing or not self._caches(req) or req.block_ids or req.wants_prompt_logprobs:
            return False
        if num_hit >= (req.num_tokens - 1) // self.block_size or req.swapped_tokens > num_hit * self.block_size:
            return False  # nothing of its own to compute that could be shared, or its next block is in its copy
        return req.block_hashes(num_hit + 1)[num_hit] in computing

    def _register_full_blocks(self, req: Request) -> None:
        """Name every block of `req` that is full of computed KV and not yet offered to the pool."""
        if not self._caches(req):
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return
        hashes = req.block_hashes(full)
        for i in range(req.num_registered_blocks, full):
            self.pool.register(req.block_ids[i], hashes[i])
        req.num_registered_blocks = full

    # -- helpers ----------------------------------------------------------------------------

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"duplicate request id {request_id!r}")

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reserve(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `req` blocks for `num_tokens`, preempting from the tail of `running` as needed.
        Returns False if `req` itself had to be preempted."""
        need = self._blocks_for(num_tokens) - len(req.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        out.preempted.append(req)
        if self.swap is not None:
            num_blocks = self._blocks_for(req.num_computed_tokens)
            decision = self.swap.choose(req.num_computed_tokens, num_blocks)
            out.preempt_decisions.append(decision)
            if decision.choice == SWAP:
                out.swap_out.append(SwapOut(req, req.block_ids[:num_blocks]))
                req.swapped_tokens = req.num_computed_tokens
        self._release_blocks(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def _swap_in(self, req: Request, num_hit: int, out: SchedulerOutput) -> None:
        """At re-admission of a swapped-out request holding its hit blocks and the new ones: bring back the blocks
        of its copy past the hit and count its tokens computed."""
        copied = self._blocks_for(req.swapped_tokens)
        back = req.block_ids[num_hit:copied]
        out.swap_in.append(SwapIn(req, back, num_hit))
        req.num_computed_tokens = max(req.num_computed_tokens, req.swapped_tokens)
        self.swap.release(copied)
        req.swapped_tokens = 0

    def drop_swap(self, req: Request) -> None:
        """Give back a swapped-out request's space and drop its copy: it ends, or the engine could not copy it out
        (it then recomputes at re-admission). Nothing for a request not swapped out."""
        if req.swapped_tokens:
            self.swap.release(self._blocks_for(req.swapped_tokens))
            req.swapped_tokens = 0
            req.swapped_kv = None

    def _release_blocks(self, req: Request) -> None:
        # Named blocks keep their names in the free queue: they stay cached until reused.
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_registered_blocks = 0
