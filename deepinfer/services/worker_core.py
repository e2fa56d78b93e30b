"""The worker service's pure core: which requests this worker holds, and the P/D handoff of each.

No sockets, no asyncio, no engine: every event comes in as a call (with `now`, monotonic seconds, where
time matters) and the core answers with `Action`s (`worker_actions`) — messages to send and engine commands
to run — that the shell (`worker.WorkerService`) performs in order. The engine's answers to those commands
come back as events (`on_exported`, `on_installed`, …).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from deepinfer.config.kv import KvSpec
from deepinfer.engine.request import InvalidRequestError, RequestOutput
from deepinfer.protocol.messages import (
    DetokenizeBatch,
    DetokenizeItem,
    ErrorCode,
    ErrorReply,
    HeldRequest,
    KvAck,
    KvReserve,
    KvReserveReply,
    KvTransfer,
    PrefillDone,
    PrefillJob,
    Reclaim,
    SamplingParamsWire,
)
from deepinfer.services.stream_coalescer import STREAM_INTERVAL_S, StreamCoalescer
from deepinfer.services.wire import to_wire_logprobs, to_wire_prompt_logprobs
from deepinfer.services.worker_actions import (
    Abort,
    AbortAll,
    Action,
    AddJob,
    CancelReservation,
    ExportKv,
    Install,
    OfferBlocks,
    Release,
    ToDecode,
    ToPrefill,
    ToRouter,
    ToTokenizer,
)

HANDOFF_TIMEOUT_S = 30.0  # the most a prefill worker waits for each of the decode worker's replies
LEASE_S = 10.0  # asked of the decode worker: how long it keeps blocks reserved for a KvTransfer
# How long a request kept through a router restart waits for its client to resume it on the new router:
# the client's window (RESUME_WITHIN_S, 30 s) and the router's wait for reports, with room to spare.
HELD_FOR_S = 60.0
# A reclaimable request that finished here is remembered until the router acknowledges its end (the
# AbortRequest every end sends its holders): if the router died before its end reached the client, the
# client resumes it on the next router and its output is taken from here. Bounded in tokens and age.
UNACKED_TOKENS = 1 << 20
UNACKED_S = 60.0


def split_resumed(token_ids: list[int], num_output_tokens: int) -> tuple[list[int], list[int]]:
    """A job's tokens as (prompt, output already streamed); ValueError when the count is impossible."""
    if not 0 <= num_output_tokens < len(token_ids):
        raise ValueError(f"num_output_tokens {num_output_tokens} does not fit {len(token_ids)} tokens")
    cut = len(token_ids) - num_output_tokens
    return list(token_ids[:cut]), list(token_ids[cut:])


# -- per-request records -------------------------------------------------------------------------------


class HandoffState(enum.Enum):
    EXPORTING = "exporting"  # ExportKv asked of the engine
    RESERVING = "reserving"  # KvReserve sent, KvReserveReply awaited
    TRANSFERRING = "transferring"  # KvTransfer sent, KvAck awaited
    DONE = "done"  # acknowledged: PrefillDone sent, blocks released
    FAILED = "failed"  # ErrorReply sent, blocks released
    DROPPED = "dropped"  # aborted or the router restarted: nothing more is sent, the engine abort frees it


class HandoffFailure(enum.Enum):
    """Why a handoff failed; `code` is what the router's ErrorReply handling acts on."""

    UNKNOWN_PEER = "unknown decode worker"
    ERROR = "export or send raised"
    RESERVE_REFUSED = "the decode worker had no room"  # the router retries once elsewhere
    KV_REFUSED = "the decode worker refused the KV"
    TIMED_OUT = "the decode worker did not answer"

    @property
    def code(self) -> ErrorCode:
        return _FAILURE_CODES[self]


_FAILURE_CODES: dict[HandoffFailure, ErrorCode] = {
    HandoffFailure.UNKNOWN_PEER: "internal",
    HandoffFailure.ERROR: "internal",
    HandoffFailure.RESERVE_REFUSED: "overloaded",
    HandoffFailure.KV_REFUSED: "internal",
    HandoffFailure.TIMED_OUT: "worker_lost",
}
_LIVE = (HandoffState.EXPORTING, HandoffState.RESERVING, HandoffState.TRANSFERRING)


@dataclass(eq=False)
class Handoff:
    out: RequestOutput  # the held request's final output: first token, usage, block hashes
    peer: str  # the decode worker
    state: HandoffState = HandoffState.EXPORTING
    kv: Any = None  # the export, from RESERVING on
    lease_id: str = ""  # granted, from TRANSFERRING on
    deadline: float = float("inf")  # for the reply awaited in RESERVING / TRANSFERRING
    failure: HandoffFailure | None = None
    started: float = 0.0  # when the prefill ended and the handoff began


@dataclass(eq=False)
class Track:
    """What this worker remembers about a request it holds."""

    detokenizer: str
    sent: int = 0  # generated tokens already pushed to the tokenizer (a resumed request's from its start)
    job: PrefillJob | None = None  # None on the decode side of a handoff
    prefill_reported: bool = False  # PrefillDone sent (co-located: with the first token computed here)
    started: float = 0.0
    fetch_s: float = 0.0  # spent loading cached blocks from the cache daemon
    handoff: Handoff | None = None
    prompt_logprobs_sent: bool = False  # the request's first DetokenizeItem carried them (they go once)
    streamed: bool = False  # some of its tokens went to the tokenizer (later ones may be held: StreamCoalescer)
    # Kept through a router restart when its client can resume it (`reclaimable`): the request's name by
    # its client ("" when not reclaimable), its whole sequence so far and its prompt's length, to check a
    # Reclaim against; while orphaned (no router holds it) its output is held here, not streamed.
    client_key: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0
    orphaned_at: float | None = None
    finish_reason: str | None = None  # it finished while orphaned


def reclaimable(client_key: str, params: SamplingParamsWire) -> str:
    """The client key a worker keeps a request under through a router restart, or "" when it is not kept:
    one asking for logprobs is not (they are not kept here to send again), nor one without a key."""
    return client_key if params.logprobs is None and params.prompt_logprobs is None else ""


# -- the core ------------------------------------------------------------------------------------------


class WorkerCore:
    """Per-request bookkeeping of one worker, and the prefill side's handoff state machine.

    Roles: "worker" runs a job to the end here; "prefill" hands each job's KV to the decode worker the
    router named; "decode" (and "worker") installs KV handed to it.

    Contract, for every request the core holds (a `Track`, from an accepted PrefillJob or KvTransfer):
    * It ends exactly once on this worker: a finished DetokenizeItem, an ErrorReply, PrefillDone after an
      acknowledged handoff, or silently by abort, router restart or an unclaimed hold; its track is then gone.
      Nothing is sent about it afterwards: late engine outputs, replies and export results are dropped
      (counted in `stale`).
    * Router restart: a request decoding here whose client can resume it (`reclaimable`) is kept, orphaned:
      the engine goes on with it, nothing of it is streamed, its tokens are kept; `held()` lists them for the
      new router. A `Reclaim` whose tokens begin its sequence ends the orphanhood: one DetokenizeItem from
      the client's output count carries every token past it (and the finish, if it came meanwhile), and it
      streams on. Unclaimed for `held_for_s`, it is aborted. Every other request is dropped at the restart.
    * PrefillDone is sent exactly once per job: with the first token computed here (co-located), or when
      the decode worker acknowledged the KV (prefill). A decode-side track never sends one.
    * DetokenizeItem offsets are contiguous: the first starts at the tokens already streamed (a resumed
      job's `num_output_tokens`; on the decode side, those plus the transferred first token).
    * Handoff (prefill role): EXPORTING → RESERVING → TRANSFERRING → DONE, or FAILED from any of them with
      one ErrorReply (`HandoffFailure.code`), or DROPPED by abort/restart. DONE and FAILED end with
      Release of the held blocks; DROPPED comes with Abort/AbortAll, which frees them too — no path leaks.
      RESERVING and TRANSFERRING each wait at most `handoff_timeout_s` (timed by `on_tick`); a reply
      counts only from the awaited peer, in the awaited state (a KvAck: for the granted lease).
    * Decode side: a transfer is checked (layout, block size, resumed count) before anything is kept; the
      first token is pushed to its tokenizer before `Install`, so it precedes every token the engine makes;
      a refused or failed install cancels the reservation and answers KvAck(ok=False).
    """

    def __init__(self, instance: str, role: str, kv: KvSpec, decode_peers: set[str] | frozenset[str], *,
                 offer_blocks: bool = False, handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
                 lease_s: float = LEASE_S, stream_interval_s: float = STREAM_INTERVAL_S,
                 held_for_s: float = HELD_FOR_S) -> None:
        self.instance = instance
        self.role = role
        self.kv = kv  # the engine's KV: a KvTransfer names its layout, and a decode worker takes only its own
        self.block_size = kv.block_size
        self.decode_peers = frozenset(decode_peers)
        self.offer_blocks = offer_blocks  # a cache daemon takes finished requests' blocks
        self.handoff_timeout_s = handoff_timeout_s
        self.lease_s = lease_s
        self.held_for_s = held_for_s
        self.handoffs_done = 0
        self.handoffs_failed: Counter[HandoffFailure] = Counter()
        self.stale = 0  # replies and export results for handoffs no longer awaiting them
        self._tracks: dict[str, Track] = {}
        self.stream = StreamCoalescer(stream_interval_s)  # tokens on their way to the tokenizers
        # Finished here, their end not yet acknowledged by the router (oldest first), with when they finished.
        self._unacked: dict[str, tuple[float, Track]] = {}
        self._unacked_tokens = 0

    def __len__(self) -> int:
        return len(self._tracks)

    def owed(self) -> int:
        """Requests this worker still owes an answer: every one it holds but the finished orphans. Those wait
        for a Reclaim that may never come (most finished before the router restarted, their ends delivered),
        so a drain does not wait for them; a client resuming one after this worker stopped gets it computed
        again, output unchanged."""
        return sum(1 for t in self._tracks.values() if t.orphaned_at is None or t.finish_reason is None)

    def track(self, request_id: str) -> Track | None:
        return self._tracks.get(request_id)

    # -- the router's jobs, aborts and restarts ------------------------------------------------------

    def on_job(self, job: PrefillJob, now: float) -> list[Action]:
        try:
            prompt, resumed = split_resumed(job.token_ids, job.num_output_tokens)
        except ValueError as exc:
            return [ToRouter(ErrorReply(job.request_id, "invalid_request", str(exc)))]
        key = reclaimable(job.client_key, job.params) if self.role != "prefill" else ""
        self._tracks[job.request_id] = Track(job.detokenizer, sent=len(resumed), job=job, started=now, client_key=key,
                                             tokens=list(job.token_ids) if key else [], prompt_len=len(prompt))
        return [AddJob(job, prompt, resumed, prefill_only=self.role == "prefill")]

    def on_prefix_loaded(self, job: PrefillJob, fetch_s: float) -> bool:
        """Its cached prefix is on the device after `fetch_s`; False if the job was dropped meanwhile (then
        it must not be added)."""
        track = self._tracks.get(job.request_id)
        if track is None or track.job is not job:
            return False
        track.fetch_s = fetch_s
        return True

    def on_add_failed(self, job: PrefillJob, error: Exception) -> list[Action]:
        """The engine refused the job: InvalidRequestError left it untouched; anything else may have left
        part of it, so it is aborted too."""
        track = self._tracks.get(job.request_id)
        if track is None or track.job is not job:
            return []  # dropped meanwhile: the abort that dropped it covers the engine
        del self._tracks[job.request_id]
        if isinstance(error, InvalidRequestError):
            return [ToRouter(ErrorReply(job.request_id, "invalid_request", str(error)))]
        return [ToRouter(ErrorReply(job.request_id, "internal", f"adding the request failed: {error}")),
                Abort(job.request_id)]

    def on_abort(self, request_id: str) -> list[Action]:
        """Drop it whatever its phase; the engine abort frees what it holds (running, held, reserved). For a
        request that finished here it is the router's acknowledgement of the end."""
        self._forget_unacked(request_id)
        track = self._tracks.pop(request_id, None)
        if track is not None and track.handoff is not None:
            track.handoff.state = HandoffState.DROPPED
        return [Abort(request_id)]

    def on_router_restart(self, now: float) -> list[Action]:
        """Every request here was the old router's. Keep those decoding here that their clients can resume on
        the new router (orphaned, output held; an orphan of an earlier restart stays one, from its first
        orphaning), and those that finished here without the router acknowledging their end; drop the rest."""
        keep: set[str] = set()
        for rid, track in list(self._tracks.items()):
            if track.orphaned_at is not None or (track.client_key and track.handoff is None
                                                 and (track.job is None or track.prefill_reported)):
                if track.orphaned_at is None:
                    track.orphaned_at = now
                self.stream.drop(rid)  # held tokens: kept in `tokens`, sent from the client's count on Reclaim
                keep.add(rid)
            else:
                if track.handoff is not None:
                    track.handoff.state = HandoffState.DROPPED
                del self._tracks[rid]
        for rid, (_, track) in self._unacked.items():  # finished: their ends may never have reached the clients
            track.orphaned_at = now
            self._tracks[rid] = track
            keep.add(rid)
        self._unacked.clear()
        self._unacked_tokens = 0
        return [AbortAll(frozenset(keep))]

    def held(self) -> list[HeldRequest]:
        """What this worker kept through a router restart, for the new router (`HeldRequests`)."""
        return [HeldRequest(rid, t.client_key, len(t.tokens) - t.prompt_len)
                for rid, t in self._tracks.items() if t.orphaned_at is not None]

    def on_reclaim(self, rc: Reclaim, step: int) -> list[Action]:
        """A client resumed an orphan on the new router: check that its output begins the orphan's (the same
        prompt, the same tokens), then stream everything past it; refused with ErrorReply worker_lost."""
        rid, n = rc.request_id, rc.num_output_tokens
        track = self._tracks.get(rid)
        if track is None or track.orphaned_at is None:
            return [ToRouter(ErrorReply(rid, "worker_lost", f"{self.instance} does not hold {rid} any more"))]
        if not 0 <= n <= len(rc.token_ids) or len(rc.token_ids) - n != track.prompt_len \
                or track.tokens[:len(rc.token_ids)] != rc.token_ids:
            del self._tracks[rid]
            return [ToRouter(ErrorReply(rid, "worker_lost", f"{self.instance} holds {rid} with another sequence")),
                    Abort(rid)]
        track.orphaned_at, track.detokenizer = None, rc.detokenizer
        output = track.tokens[track.prompt_len:]
        track.sent, track.streamed = len(output), True
        if track.finish_reason is not None:
            del self._tracks[rid]
        elif len(output) == n:
            return []  # nothing new yet: the next step streams on from n
        item = DetokenizeItem(rid, n, output[n:], track.finish_reason is not None, track.finish_reason)
        return [ToTokenizer(rc.detokenizer, DetokenizeBatch(self.instance, step, [item]))]

    def expire_held(self, now: float) -> list[Action]:
        """Abort the orphans no client resumed within `held_for_s`."""
        expired = [rid for rid, t in self._tracks.items()
                   if t.orphaned_at is not None and now - t.orphaned_at > self.held_for_s]
        for rid in expired:
            del self._tracks[rid]
        return [Abort(rid) for rid in expired]

    # -- the engine's outputs ------------------------------------------------------------------------

    def on_outputs(self, outputs: list[RequestOutput], step: int, now: float) -> list[Action]:
        """One engine step's outputs: PrefillDone with a job's first token, ErrorReply for an engine error,
        handoffs started; then the new tokens, one DetokenizeBatch per tokenizer, unless they may wait for
        the stream interval (`stream_flush`; see stream_coalescer.py: first tokens and finishes never wait)."""
        actions: list[Action] = []
        urgent = False
        for out in outputs:
            rid = out.request_id
            track = self._tracks.get(rid)
            if track is None or track.handoff is not None:
                continue  # aborted meanwhile (the engine still reports the abort), or already handed off
            if out.handoff:
                actions += self._start_handoff(track, out, now)
                continue
            if track.job is not None and not track.prefill_reported and out.new_token_ids:
                track.prefill_reported = True
                actions.append(ToRouter(self._prefill_done(out, track, now)))
            if out.finish_reason is not None and out.finish_reason.value == "error":
                del self._tracks[rid]
                if track.orphaned_at is None:
                    actions.append(ToRouter(ErrorReply(rid, "internal", out.error or "")))
                continue
            if track.client_key:  # every orphan has one: only a reclaimable request is kept
                track.tokens += out.new_token_ids
                if out.finished:
                    track.finish_reason = out.finish_reason.value if out.finish_reason else "stop"
            if track.orphaned_at is not None:  # no router holds it: its output waits for a Reclaim
                if out.finished and self.offer_blocks and out.block_hashes:
                    actions.append(OfferBlocks(rid, list(out.block_hashes)))
                continue
            prompt_logprobs = None
            if out.prompt_logprobs is not None and not track.prompt_logprobs_sent:
                prompt_logprobs, track.prompt_logprobs_sent = to_wire_prompt_logprobs(out.prompt_logprobs), True
            self.stream.add(track.detokenizer, DetokenizeItem(
                rid, track.sent, list(out.new_token_ids), out.finished,
                out.finish_reason.value if out.finish_reason else None,
                to_wire_logprobs(out.new_logprobs),  # one per new token: the step's own
                prompt_logprobs=prompt_logprobs,
                spec_proposed_tokens=out.usage.spec_proposed_tokens,
                spec_accepted_tokens=out.usage.spec_accepted_tokens))
            urgent |= out.finished or (not track.streamed and bool(out.new_token_ids))
            track.sent += len(out.new_token_ids)
            track.streamed |= bool(out.new_token_ids)
            if out.finished:
                del self._tracks[rid]
                if track.client_key:
                    self._remember_unacked(rid, track, now)
                if self.offer_blocks and out.block_hashes:
                    actions.append(OfferBlocks(rid, list(out.block_hashes)))
        if urgent or self.stream.due(now):
            actions += self.stream_flush(step, now)
        return actions

    def stream_flush(self, step: int, now: float) -> list[Action]:
        """Send every held item (the shell calls this when the interval has passed and no step did). Items
        of requests that ended meanwhile without a finished item (aborted, failed) are dropped: nothing is
        sent about a request after it ended."""
        if not self.stream:
            return []
        actions: list[Action] = []
        for tok, items in self.stream.take(now).items():
            live = [it for it in items if it.finished or self._streaming(it.request_id)]
            if live:
                actions.append(ToTokenizer(tok, DetokenizeBatch(self.instance, step, live)))
        return actions

    def _remember_unacked(self, rid: str, track: Track, now: float) -> None:
        self._unacked[rid] = (now, track)
        self._unacked_tokens += len(track.tokens)
        while self._unacked:  # the oldest go first, past the age or the token bound
            oldest, (at, t) = next(iter(self._unacked.items()))
            if now - at <= UNACKED_S and self._unacked_tokens <= UNACKED_TOKENS:
                break
            self._forget_unacked(oldest)

    def _forget_unacked(self, rid: str) -> None:
        entry = self._unacked.pop(rid, None)
        if entry is not None:
            self._unacked_tokens -= len(entry[1].tokens)

    def _streaming(self, request_id: str) -> bool:
        track = self._tracks.get(request_id)
        return track is not None and track.orphaned_at is None

    def _prefill_done(self, out: RequestOutput, track: Track, now: float) -> PrefillDone:
        assert track.job is not None
        handoff_s = now - track.handoff.started if track.handoff is not None else 0.0
        return PrefillDone(out.request_id, self.instance, len(track.job.token_ids), out.usage.cached_tokens,
                           dict(out.usage.cached_by_tier), prefill_s=now - track.started, fetch_s=track.fetch_s,
                           handoff_s=handoff_s)

    # -- prefill side of the handoff -----------------------------------------------------------------

    def _start_handoff(self, track: Track, out: RequestOutput, now: float) -> list[Action]:
        peer = track.job.decode_worker if track.job is not None else ""
        track.handoff = Handoff(out, peer, started=now)
        if peer not in self.decode_peers:
            return self._fail(track, HandoffFailure.UNKNOWN_PEER, f"handoff failed: unknown decode worker {peer!r}")
        # Export first: the engine thread may be busy with a long prefill step, and the decode side's lease
        # must only cover the transfer, not that wait.
        return [ExportKv(out.request_id)]

    def on_exported(self, request_id: str, kv: Any, now: float) -> list[Action]:
        track = self._awaiting(request_id, HandoffState.EXPORTING)
        if track is None:
            return []  # dropped meanwhile: the abort released the blocks; the export is garbage
        hand, job = track.handoff, track.job
        assert hand is not None and job is not None
        hand.kv, hand.state, hand.deadline = kv, HandoffState.RESERVING, now + self.handoff_timeout_s
        n_blocks = -(-(len(job.token_ids) + 1) // self.block_size)  # the prompt and the first token
        return [ToDecode(hand.peer, KvReserve(request_id, n_blocks, len(job.token_ids), job.params.max_tokens,
                                              self.instance, self.lease_s))]

    def on_handoff_error(self, request_id: str, error: Exception) -> list[Action]:
        """A step of the handoff raised: the export, or a send to the decode worker."""
        track = self._awaiting(request_id, *_LIVE)
        if track is None:
            return []
        return self._fail(track, HandoffFailure.ERROR, f"handoff failed: {error}")

    def on_kv_reply(self, peer: str, reply: KvReserveReply | KvAck, now: float) -> list[Action]:
        """The decode worker `peer` answered a KvReserve or a KvTransfer."""
        rid = reply.request_id
        if isinstance(reply, KvReserveReply):
            track = self._awaiting(rid, HandoffState.RESERVING, peer=peer)
            if track is None:
                return []
            if not reply.ok:
                return self._fail(track, HandoffFailure.RESERVE_REFUSED, f"{peer}: {reply.reason}")
            return self._transfer(track, reply.lease_id, now)
        track = self._awaiting(rid, HandoffState.TRANSFERRING, peer=peer, lease_id=reply.lease_id)
        if track is None:
            return []
        if not reply.ok:
            return self._fail(track, HandoffFailure.KV_REFUSED, f"{peer} refused the KV: {reply.reason}")
        hand = track.handoff
        assert hand is not None
        del self._tracks[rid]
        hand.state, track.prefill_reported = HandoffState.DONE, True
        self.handoffs_done += 1
        actions: list[Action] = [ToRouter(self._prefill_done(hand.out, track, now))]
        if self.offer_blocks and hand.out.block_hashes:
            actions.append(OfferBlocks(rid, list(hand.out.block_hashes), hand.kv))
        return [*actions, Release(rid)]

    def _transfer(self, track: Track, lease_id: str, now: float) -> list[Action]:
        hand, job = track.handoff, track.job
        assert hand is not None and job is not None
        out = hand.out
        hand.state, hand.lease_id, hand.deadline = HandoffState.TRANSFERRING, lease_id, now + self.handoff_timeout_s
        return [ToDecode(hand.peer, KvTransfer(
            out.request_id, lease_id, out.new_token_ids[0], list(job.token_ids), list(job.block_hashes), job.params,
            self.block_size, self.kv.layout, hand.kv, job.detokenizer,
            first_logprob=(to_wire_logprobs(out.new_logprobs) or [None])[-1], priority=job.priority,
            arrival_time=job.arrival_time, num_cached_tokens=out.usage.cached_tokens, cache_salt=job.cache_salt,
            num_output_tokens=job.num_output_tokens, prompt_logprobs=to_wire_prompt_logprobs(out.prompt_logprobs),
            client_key=job.client_key))]

    def on_tick(self, now: float) -> list[Action]:
        """Fail every handoff whose awaited reply is overdue."""
        actions: list[Action] = []
        for track in [t for t in self._tracks.values() if t.handoff is not None and now >= t.handoff.deadline]:
            assert track.handoff is not None
            actions += self._fail(track, HandoffFailure.TIMED_OUT, f"{track.handoff.peer} did not answer the handoff")
        return actions

    def _awaiting(self, request_id: str, *states: HandoffState, peer: str | None = None,
                  lease_id: str | None = None) -> Track | None:
        """The track whose handoff is in one of `states` (from `peer`, under `lease_id`), else None (stale)."""
        track = self._tracks.get(request_id)
        hand = track.handoff if track is not None else None
        if (hand is None or hand.state not in states or (peer is not None and peer != hand.peer)
                or (lease_id is not None and lease_id != hand.lease_id)):
            self.stale += 1
            return None
        return track

    def _fail(self, track: Track, failure: HandoffFailure, message: str) -> list[Action]:
        hand = track.handoff
        assert hand is not None and hand.state in _LIVE
        rid = hand.out.request_id
        del self._tracks[rid]
        hand.state, hand.failure = HandoffState.FAILED, failure
        self.handoffs_failed[failure] += 1
        return [ToRouter(ErrorReply(rid, failure.code, message)), Release(rid)]

    # -- decode side of the handoff ------------------------------------------------------------------

    def on_reserved(self, identity: bytes, req: KvReserve, ok: bool, free_blocks: int) -> list[Action]:
        """The engine's answer to a KvReserve (the reservation is named after the request)."""
        reason = "" if ok else f"{req.num_blocks} KV blocks not free ({free_blocks} free)"
        rid = req.request_id
        return [ToPrefill(identity, KvReserveReply(rid, rid, ok, reason, req.lease_s if ok else 0.0))]

    def on_transfer(self, identity: bytes, t: KvTransfer, step: int) -> list[Action]:
        if t.kv_layout != self.kv.layout or t.block_size != self.block_size:
            return self._refuse(identity, t, f"KV layout {t.kv_layout!r}/block {t.block_size} does not match "
                                             f"{self.kv.layout!r}/block {self.block_size}")
        try:
            prompt, resumed = split_resumed(t.token_ids, t.num_output_tokens)
        except ValueError as exc:
            return self._refuse(identity, t, str(exc))
        key = reclaimable(t.client_key, t.params)
        self._tracks[t.request_id] = Track(t.detokenizer, sent=len(resumed) + 1, streamed=True, client_key=key,
                                           tokens=[*t.token_ids, t.first_token] if key else [], prompt_len=len(prompt))
        # The first token goes to the tokenizer before the engine can produce the second: the shell performs
        # these in order, and one PUSH socket per tokenizer keeps them in order. It carries the prefill
        # worker's logprob of that token and the prompt's logprobs, when the request asked for them.
        first_logprobs = [t.first_logprob] if t.first_logprob is not None and t.params.logprobs is not None else None
        item = DetokenizeItem(t.request_id, len(resumed), [t.first_token], logprobs=first_logprobs,
                              prompt_logprobs=t.prompt_logprobs)
        first = DetokenizeBatch(self.instance, step, [item])
        return [ToTokenizer(t.detokenizer, first), Install(identity, t, prompt, resumed)]

    def on_installed(self, identity: bytes, t: KvTransfer) -> list[Action]:
        return [ToPrefill(identity, KvAck(t.request_id, t.lease_id, True))]

    def on_install_failed(self, identity: bytes, t: KvTransfer, error: Exception) -> list[Action]:
        track = self._tracks.get(t.request_id)
        if track is not None and track.job is None:
            del self._tracks[t.request_id]  # ends silently here: the prefill worker reports the failure
        return self._refuse(identity, t, str(error))

    def _refuse(self, identity: bytes, t: KvTransfer, reason: str) -> list[Action]:
        return [CancelReservation(t.lease_id), ToPrefill(identity, KvAck(t.request_id, t.lease_id, False, reason))]
