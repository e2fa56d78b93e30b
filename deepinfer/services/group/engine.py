"""The group engine: a worker's N engine ranks (expert parallelism with data-parallel attention) as one engine.

`GroupEngine` implements `ServingEngine` (deepinfer.engine.interface), the calls the worker service, its engine
thread and its cache client make of an engine, as LLMEngine does, and forwards each request's calls to the rank
that owns it. What only a group has (`keepalive`, `close`, `load`, `live_ids`, the expert placement calls) the
worker calls on it as a group.

Ranks. Rank 0 (this process, the leader) owns `local`, its own LLMEngine, and speaks for the group to
the mesh; ranks 1..N-1 are follower processes (`follower.py`) holding an engine each, same model and
config. Every request lives on exactly one rank: its attention and KV stay there; with an MoE model
only the expert MLPs are shared, by the engines' all-to-all inside `step()`.

Lockstep. The group advances in rounds, all driven from the leader's engine thread:

    leader:    broadcast Round(step, commands by rank) → send install KV → [local.step()] → collect reports
    follower:  receive Round → receive install KV → apply its commands → [engine.step()] → report (+ export KV)

With `step` set, every rank calls `engine.step()` exactly once in the round, which is what an
expert-parallel engine needs (its step is a collective; a rank with nothing scheduled runs an empty
batch). A round without a step only carries commands: the group steps only while some rank has work.

Commands. Rank 0's are plain calls on `local`. A follower's fire-and-forget ones (add, abort, release,
cancel) are queued and ride on the next round; the ones whose answer the caller needs (reserve, export,
install, expert load, the cache daemon's import/export/reset) run a round at once and return its result,
raising the engine's own exception type. A queued add is first validated here with the engine's own
checks (every rank has the same model and limits), so it fails synchronously like a local one; an add
that still fails on its rank ends with an `error` output in the next step.

What the leader knows of each follower — its load, free blocks, prefix-cache names, expired leases,
stats — is its last report: a follower's engine changes only inside rounds, so that view is exact
between rounds. Placement of a new request: the rank holding the longest prefix of its prompt in its
prefix cache, among ranks within `AFFINITY_SLACK` requests of the least loaded; then fewest requests,
most free blocks. A KV reservation goes to the rank with the most free blocks, and the install that
follows to the rank holding the reservation.

Cache daemon (group_cache.py; only rank 0 talks to it): a request whose prefix is fetched is routed first
(`cache_route`: the placement above, decided once), its lookup and import go to that rank, and its
`add_request` takes that rank; write-behind exports come from the rank whose KV events named each block.

Expert placement moves (`begin_placement`, `take_placement_results`): `PlacementMoves` in moves.py
keeps the books; a round carries `switch` once every rank has staged the new placement, and every rank
switches before that round's step.

Idle and failure. When no rank has work, the engine thread calls `keepalive()`, which runs an empty
round when commands are queued, at every call while a placement move is pending (so an idle group still
finishes it), and every `KEEPALIVE_S`, so a follower waiting for the next round never runs into the
channel timeout and notices a dead leader. Any channel failure raises `GroupBroken`, and
the group is then unusable (every later call raises it): the worker exits and the supervisor restarts
the group.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import structlog
import torch

from deepinfer.cache.hashing import BlockHash, CacheNamespace
from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec
from deepinfer.engine.engine import EngineStats, LLMEngine
from deepinfer.engine.ep.move import MoveResult
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.handoff import HandoffError
from deepinfer.engine.request import (
    FinishReason,
    InvalidRequestError,
    Logprob,
    RequestOutput,
    SamplingParams,
    Usage,
)
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.weights import LoadedModel, load_model_weights
from deepinfer.services.group.cache import GroupCache, RankCache
from deepinfer.services.group.channel import ControlChannel, GroupBroken, join_group
from deepinfer.services.group.control import (
    Command,
    Hello,
    Load,
    Op,
    Report,
    Round,
    encode_logprob,
    encode_params,
    engine_load,
    kv_from_meta,
    kv_meta,
    kv_out_meta,
    raise_if_error,
)
from deepinfer.services.group.moves import PlacementMoves
from deepinfer.text.tokenizer import Tokenizer

__all__ = ["GroupBroken", "GroupEngine", "build_engine"]

log = structlog.get_logger("deepinfer.group")

KEEPALIVE_S = 5.0  # an idle leader runs an empty round this often (far below channel.CONTROL_TIMEOUT_S)
AFFINITY_SLACK = 2  # a cached prefix may draw a request to a rank this many requests busier than the least


def build_engine(model: str, config: EngineConfig, ep_group: Any) -> LLMEngine:
    """One rank's engine, built the same way on every rank of a group."""
    path = resolve_model(model)
    return rank_engine(load_model_weights(path, config.weights, config.device), Tokenizer.load(path), config, ep_group)


def rank_engine(loaded: LoadedModel, tokenizer: Tokenizer | None, config: EngineConfig, ep_group: Any) -> LLMEngine:
    """A rank's engine: expert-parallel over `ep_group` for an MoE model; a dense model's ranks share
    nothing (data-parallel attention alone), so its engines stay plain."""
    if ep_group is None or loaded.config.moe is None:
        return LLMEngine(loaded, tokenizer, config)
    return LLMEngine(loaded, tokenizer, config, ep_group=ep_group)


class GroupPool:
    """The group's prefix-cache names as one pool: a name is present while any rank holds it (what the
    worker publishes to the router's prefix index)."""

    def __init__(self, group: GroupEngine) -> None:
        self._group = group

    @property
    def num_blocks(self) -> int:
        return self._group.load().total_blocks

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._group._holders)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        g = self._group
        g._absorb_local_events()
        changes, g._changes = g._changes, {}
        return [h for h, present in changes.items() if present], [h for h, present in changes.items() if not present]


class GroupEngine:
    """Rank 0 of a worker group: a `ServingEngine` over every rank (see the module docstring)."""

    def __init__(self, local: LLMEngine, channel: ControlChannel, *, ep_group: Any = None) -> None:
        self.local = local
        self.channel = channel
        self.ep_group = ep_group
        self.size = channel.size
        # What every rank shares: the worker reads these as it would an LLMEngine's.
        self.config: EngineConfig = local.config
        self.fingerprint: str = local.fingerprint
        self.tokenizer = local.tokenizer
        self.kv_spec: KvSpec = local.kv_spec
        self.cache_namespace: CacheNamespace = local.cache_namespace
        self.max_model_len: int = local.max_model_len
        self.model_config = local.model_config
        self.pool = GroupPool(self)
        self.broken: GroupBroken | None = None
        self.rounds = 0
        self._queued: list[list[Command]] = [[] for _ in range(self.size)]
        self._queued_adds = [0] * self.size  # adds sent since the rank's last report (not in its load yet)
        self._kv_out: list[tuple[int, torch.Tensor]] = []  # install KV to send after the next broadcast
        self._loads: list[Load] = [Load() for _ in range(self.size)]  # followers' last reports
        self._stats: list[dict[str, int]] = [{} for _ in range(self.size)]
        self._owner: dict[str, int] = {}  # live or held request → its rank
        self._held: set[str] = set()  # held for export (prefill side of a handoff)
        self._reserved: dict[str, int] = {}  # reservation → its rank
        self._failed: list[RequestOutput] = []  # adds that failed on their rank, reported by the next step
        self._hashes: list[set[BlockHash]] = [set() for _ in range(self.size)]
        self._holders: Counter[BlockHash] = Counter()  # name → how many ranks hold it
        self._changes: dict[BlockHash, bool] = {}  # net group-level changes since the worker last drained
        self._last_round = time.monotonic()
        self._last_tokens = [0] * self.size  # tokens_computed at the last expert-load report
        self._moves = PlacementMoves(local, self.size, lambda rank, command: self._queued[rank].append(command))
        self.cache = GroupCache(self)

    @classmethod
    def start(cls, model: str, config: EngineConfig, size: int, master: str) -> GroupEngine:
        """Join the group as rank 0 (waits for every rank), load the model, and check every follower
        loaded the same one."""
        channel, ep_group = join_group(size, 0, master, config.device, config.ep_timeout_s)
        group = cls(build_engine(model, config, ep_group), channel, ep_group=ep_group)
        group.greet()
        return group

    def greet(self) -> None:
        """Read each follower's Hello: same model, KV layout and cache namespace as rank 0, or the group is
        refused (GroupBroken)."""
        for r in range(1, self.size):
            hello = Hello.decode(self._guarded(lambda r=r: self.channel.collect(r)))
            mine = (self.fingerprint, self.kv_spec.layout, self.cache_namespace.id)
            theirs = (hello.fingerprint, hello.kv_layout, hello.namespace)
            if hello.rank != r or theirs != mine:
                self._break(GroupBroken(f"rank {r} (says rank {hello.rank}) has model/KV/namespace {theirs}; "
                                        f"rank 0 has {mine}"))
            self._loads[r] = hello.load
        log.info("group ready", size=self.size, free_blocks=self.num_free_blocks)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0, *, prefill_only: bool = False, cache_salt: str | None = None,
                    resume_output_ids: Sequence[int] = ()) -> str:
        """As LLMEngine.add_request, on the rank `cache_route` chose or else placed now; token ids under an
        id only. A follower's add is validated here and sent with the next round."""
        self._check()
        if request_id is None or isinstance(prompt, str):
            raise InvalidRequestError("a group takes token ids under a request id")
        prompt_ids, resumed = list(prompt), list(resume_output_ids)
        self._check_id_free(request_id)
        rank = self.cache.take_route(request_id)  # where its cached prefix was looked up and imported
        if rank is None:
            rank = self._place(prompt_ids + resumed, cache_salt)
        if rank == 0:
            self.local.add_request(request_id, prompt_ids, params, priority, prefill_only=prefill_only,
                                   cache_salt=cache_salt, resume_output_ids=resumed)
        else:
            # The engine's own checks, as the rank would make them: an invalid request fails here, now.
            self.local._validate(prompt_ids, params, resumed)
            self._queued[rank].append([Op.ADD, request_id, prompt_ids, encode_params(params), priority,
                                       prefill_only, cache_salt, resumed])
            self._queued_adds[rank] += 1
        self._owner[request_id] = rank
        return request_id

    def abort(self, request_id: str) -> bool:
        """As LLMEngine.abort, on the rank that has it. A follower's abort is applied with the next round;
        True when something of that id was live there."""
        self._check()
        self.cache.drop_route(request_id)
        cancelled = self.cancel_reservation(request_id)
        rank = self._owner.get(request_id)
        if rank is None:
            return cancelled
        if request_id in self._held:  # a held request ends here, with no further output
            self._held.discard(request_id)
            del self._owner[request_id]
        if rank == 0:
            return self.local.abort(request_id) or cancelled
        self._queued[rank].append([Op.ABORT, request_id])
        return True

    def has_unfinished(self) -> bool:
        """Whether any rank has work or an output is owed (a follower's as of its last report, plus adds since)."""
        return bool(self._failed) or self.local.has_unfinished() or any(
            self._loads[r].unfinished or self._queued_adds[r] for r in range(1, self.size))

    @property
    def num_free_blocks(self) -> int:
        return self.load().free_blocks

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_reserved_blocks(self) -> int:
        return self.load().num_reserved_blocks

    @property
    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def rank_of(self, request_id: str) -> int | None:
        """The rank a live or held request is on (None: unknown here)."""
        return self._owner.get(request_id)

    def live_ids(self) -> set[str]:
        """Every id something is kept under, on any rank: requests, held requests, reservations."""
        return {*self._owner, *self._reserved}

    # -- the cache daemon's calls (group_cache.py) ----------------------------------------------

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The chain hashes of the full blocks of `token_ids` (every rank names blocks alike)."""
        return self.local.block_hashes(token_ids, cache_salt)

    def cache_route(self, request_id: str, hashes: Sequence[BlockHash]) -> RankCache:
        """Place request `request_id` (its prompt's chain `hashes`) now: its cached-prefix lookup and import
        go through the returned view, and its `add_request` goes to the same rank."""
        return self.cache.route(request_id, hashes)

    def export_cached_blocks(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], torch.Tensor | None]:
        """As LLMEngine.export_cached_blocks, each block from a rank holding it (write-behind)."""
        return self.cache.export(hashes)

    def reset_prefix_cache(self) -> int:
        """As LLMEngine.reset_prefix_cache, on every rank."""
        return self.cache.reset()

    # -- prefill side of a handoff ------------------------------------------------------------

    def export_kv(self, request_id: str) -> torch.Tensor:
        """As LLMEngine.export_kv, from the rank holding the request (a follower's in one round)."""
        self._check()
        rank = self._owner.get(request_id)
        if rank is None or request_id not in self._held:
            raise HandoffError(f"request {request_id!r} is not held for handoff")
        if rank == 0:
            return self.local.export_kv(request_id)
        result, kv = self._call(rank, [Op.EXPORT, request_id])
        raise_if_error(result)
        assert kv is not None
        return kv

    def release(self, request_id: str) -> bool:
        """As LLMEngine.release, on the rank holding the request (a follower's with the next round)."""
        self._check()
        if request_id not in self._held:
            return False
        self._held.discard(request_id)
        rank = self._owner.pop(request_id)
        if rank == 0:
            return self.local.release(request_id)
        self._queued[rank].append([Op.RELEASE, request_id])
        return True

    # -- decode side of a handoff -------------------------------------------------------------

    def reserve(self, reservation_id: str, num_blocks: int, lease_s: float, now: float | None = None) -> bool:
        """Reserve on the rank with the most free blocks (if it cannot, none can). `now` applies to rank 0
        only: each rank measures leases on its own clock."""
        self._check()
        if reservation_id in self._reserved:
            return False
        rank = self._place_reservation()
        if rank == 0:
            ok = self.local.reserve(reservation_id, num_blocks, lease_s, now)
        else:
            ok = bool(raise_if_error(self._call(rank, [Op.RESERVE, reservation_id, num_blocks, lease_s])[0]))
        if ok:
            self._reserved[reservation_id] = rank
        return ok

    def expire_reservations(self, now: float | None = None) -> list[str]:
        """Rank 0's expired leases now; a follower expires its own at every round (and reports them)."""
        self._check()
        expired = self.local.expire_reservations(now)
        self._forget_reservations(0, expired)
        return expired

    def cancel_reservation(self, reservation_id: str) -> bool:
        """As LLMEngine.cancel_reservation, on the rank holding it (a follower's with the next round)."""
        self._check()
        rank = self._reserved.pop(reservation_id, None)
        if rank is None:
            return False
        if rank == 0:
            return self.local.cancel_reservation(reservation_id)
        self._queued[rank].append([Op.CANCEL, reservation_id])
        return True

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], first_token: int,
                              params: SamplingParams, kv: torch.Tensor, reservation_id: str | None = None,
                              priority: int = 0, first_logprob: Logprob | None = None,
                              cache_salt: str | None = None, resume_output_ids: Sequence[int] = ()) -> str:
        """As LLMEngine.add_prefilled_request, on the rank holding the reservation (without one: placed as a
        new request); the KV goes to that rank at once."""
        self._check()
        self._check_id_free(request_id)
        prompt_ids, resumed = list(prompt_token_ids), list(resume_output_ids)
        if reservation_id is not None:
            rank = self._reserved.get(reservation_id)
            if rank is None:
                raise HandoffError(f"unknown or expired reservation {reservation_id!r}")
        else:
            rank = self._place(prompt_ids + resumed, cache_salt)
        if rank == 0:
            self.local.add_prefilled_request(request_id, prompt_ids, first_token, params, kv, reservation_id,
                                             priority, first_logprob, cache_salt, resumed)
        else:
            self._kv_out.append((rank, kv))
            raise_if_error(self._call(rank, [
                Op.INSTALL, request_id, prompt_ids, first_token, encode_params(params), kv_meta(kv),
                reservation_id, priority, encode_logprob(first_logprob), cache_salt, resumed])[0])
        if reservation_id is not None:
            del self._reserved[reservation_id]
        self._owner[request_id] = rank
        return request_id

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One group step: every rank applies its queued commands and steps once. Raises GroupBroken if a
        rank is gone."""
        self._check()
        outputs, self._failed = self._failed, []
        return outputs + self._round(step=True)[0]

    def keepalive(self) -> None:
        """While idle (no rank has work): send queued commands now, run a round at every call while a
        placement move is pending, and an empty round every KEEPALIVE_S."""
        self._check()
        if any(self._queued) or self._moves.pending or time.monotonic() - self._last_round >= KEEPALIVE_S:
            self._round(step=False)

    def close(self) -> None:
        """Tell every follower to exit (0), then leave the group. Never raises: the group may be gone."""
        if self.broken is None:
            try:
                self._round(step=False, stop=True)
            except GroupBroken:
                pass
        self.local.stop_staging()  # rank 0's loading thread too: none may outlive the interpreter
        self.channel.close()

    @property
    def stats(self) -> EngineStats:
        """Every rank's counters summed (a follower's as of its last report)."""
        total = dataclasses.asdict(self.local.stats)
        for s in self._stats[1:]:
            for k, v in s.items():
                total[k] = total.get(k, 0) + v
        return EngineStats(**total)

    def load(self) -> Load:
        """The group's load: every rank's summed (rank 0's now, the others' as of their last report)."""
        loads = self._rank_loads()
        total = loads[0]
        for other in loads[1:]:
            total = total + other
        return total

    @property
    def placement_version(self) -> int:
        """The version of the expert placement the ranks run (0 for a dense model)."""
        placement = self.local.ep_placement
        return placement.version if placement is not None else 0

    @property
    def placement(self) -> ExpertPlacement | None:
        """The expert placement every rank runs now (None for a dense model)."""
        return self.local.ep_placement

    def begin_placement(self, placement: ExpertPlacement) -> None:
        """Start moving the group to `placement` (staged on every rank, then switched at one round).
        PlacementRefused: a dense model, another group shape, a version not newer than the current one,
        or a move already in progress."""
        self._check()
        self._moves.begin(placement)

    def take_placement_results(self) -> list[MoveResult]:
        """The moves that ended (switched, or dropped with the old placement kept) since the last call."""
        return self._moves.take_results()

    def take_expert_load(self) -> tuple[list[list[int]] | None, list[int], list[list[int]]]:
        """Since the last call: (tokens routed to each logical expert of each MoE layer, summed over ranks —
        None for a dense model; tokens each rank computed; per MoE layer, the assignments each rank's
        experts computed — its measured expert load, [] for a dense model). One round."""
        self._check()
        counts = take_expert_counts(self.local)
        computed = [self.local.expert_computed()]
        if self.size > 1:
            results = self._call_all({r: [Op.EXPERT_LOAD] for r in range(1, self.size)})
            for r in range(1, self.size):
                rank_counts, rank_computed = raise_if_error(results[r][0])
                counts = _add_counts(counts, rank_counts)
                computed.append(rank_computed)
        totals = [self.local.stats.tokens_computed] + [s.get("tokens_computed", 0) for s in self._stats[1:]]
        per_rank = [t - last for t, last in zip(totals, self._last_tokens)]
        self._last_tokens = totals
        by_layer = [list(layer) for layer in zip(*computed)] if all(computed) else []
        return counts, per_rank, by_layer

    # -- internals ----------------------------------------------------------------------------

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _check_id_free(self, request_id: str) -> None:
        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def _rank_loads(self) -> list[Load]:
        return [engine_load(self.local), *self._loads[1:]]

    def _place(self, token_ids: list[int], cache_salt: str | None) -> int:
        return self._place_chain(self.local.block_hashes(token_ids, cache_salt) if self._holders else [])

    def _place_chain(self, hashes: list[BlockHash]) -> int:
        loads = self._rank_loads()
        routed = self.cache.routed()  # placed by a cache route, not added yet
        busy = [loads[r].running + loads[r].waiting + self._queued_adds[r] + routed[r] for r in range(self.size)]
        cached = [0] * self.size
        if self._holders:
            for h in hashes:
                holders = [r for r in range(self.size) if h in self._hashes[r]]
                if not holders:
                    break
                for r in holders:
                    cached[r] += 1
        near = [r for r in range(self.size) if busy[r] <= min(busy) + AFFINITY_SLACK]
        return max(near, key=lambda r: (cached[r], -busy[r], loads[r].free_blocks, -r))

    def _place_reservation(self) -> int:
        loads = self._rank_loads()
        return max(range(self.size), key=lambda r: (loads[r].free_blocks, -r))

    def _call(self, rank: int, command: Command) -> tuple[Any, torch.Tensor | None]:
        return self._call_all({rank: command})[rank]

    def _call_all(self, commands: dict[int, Command]) -> dict[int, tuple[Any, torch.Tensor | None]]:
        """Run one round now carrying `commands` (after what is queued); their results and exported KV."""
        index = {}
        for rank, command in commands.items():
            index[rank] = len(self._queued[rank])
            self._queued[rank].append(command)
        _, reports, exported = self._round(step=False)
        return {r: (reports[r].results[i], exported.get((r, i))) for r, i in index.items()}

    def _round(self, step: bool, stop: bool = False) -> tuple[list[RequestOutput], dict[int, Report], dict]:
        commands, self._queued = self._queued, [[] for _ in range(self.size)]
        kv_out, self._kv_out = self._kv_out, []
        outputs: list[RequestOutput] = []
        switch = None if stop else self._moves.switch_due()
        self.rounds += 1
        self._last_round = time.monotonic()
        try:
            self.channel.broadcast(Round(step, stop, commands, switch).encode())
            for dst, kv in kv_out:  # in command order per rank: each follower receives its own in that order
                self.channel.send_kv(kv, dst)
            if switch is not None:
                self.local.switch_placement(switch)
            if step:
                before = set(self.local.reservations.ids)
                self._forget_reservations(0, self.local.expire_reservations())
                outputs = self.local.step()
                self._forget_reservations(0, sorted(before - set(self.local.reservations.ids)))
            reports = {r: Report.decode(self.channel.collect(r)) for r in range(1, self.size)}
            exported: dict[tuple[int, int], torch.Tensor] = {}
            for r in range(1, self.size):  # each follower sends its exports after its report, in command order
                for i, (command, result) in enumerate(zip(commands[r], reports[r].results)):
                    if (meta := kv_out_meta(command, result)) is not None:
                        exported[(r, i)] = self.channel.recv_kv(r, *kv_from_meta(meta))
        except Exception as exc:  # a round half done leaves the ranks out of step: the group is over
            self._break(exc if isinstance(exc, GroupBroken) else GroupBroken(f"round failed: {exc!r}"))
        for r, report in reports.items():
            self._absorb(r, commands[r], report)
            outputs += report.outputs
        self._moves.after_round(switch, {r: report.staged for r, report in reports.items()})
        self._absorb_local_events()
        for out in outputs:
            self._track_output(out)
        return outputs, reports, exported

    def _absorb(self, rank: int, commands: list[Command], report: Report) -> None:
        self._loads[rank] = report.load
        self._stats[rank] = report.stats
        self._queued_adds[rank] = 0
        self._forget_reservations(rank, report.expired)
        self._name_events(rank, report.stored, report.evicted)
        for command, result in zip(commands, report.results):
            if command[0] == Op.ADD and _is_error(result):
                rid, prompt = command[1], command[2]
                self._owner.pop(rid, None)
                self._failed.append(RequestOutput(rid, [], [], True, FinishReason.ERROR, Usage(len(prompt), 0),
                                                  error=f"rank {rank}: {result[2]}"))

    def _track_output(self, out: RequestOutput) -> None:
        if out.handoff:
            self._held.add(out.request_id)
        elif out.finished:
            self._owner.pop(out.request_id, None)

    def _forget_reservations(self, rank: int, expired: Sequence[str]) -> None:
        for rid in expired:
            if self._reserved.get(rid) == rank:
                del self._reserved[rid]

    def _absorb_local_events(self) -> None:
        stored, evicted = self.local.pool.drain_events()
        self._name_events(0, stored, evicted)

    def _name_events(self, rank: int, stored: Sequence[BlockHash], evicted: Sequence[BlockHash]) -> None:
        """A rank's prefix-cache changes; the group's name changes when the first rank stores it or the last
        evicts it."""
        mine = self._hashes[rank]
        for h in evicted:
            if h in mine:
                mine.discard(h)
                self._holders[h] -= 1
                if not self._holders[h]:
                    del self._holders[h]
                    self._note(h, False)
        for h in stored:
            if h not in mine:
                mine.add(h)
                self._holders[h] += 1
                if self._holders[h] == 1:
                    self._note(h, True)

    def _note(self, h: BlockHash, present: bool) -> None:
        # A name that came and went between two drains nets to nothing (the pool's own events do the same).
        if self._changes.get(h) is (not present):
            del self._changes[h]
        else:
            self._changes[h] = present

    def _guarded(self, fn: Any) -> Any:
        try:
            return fn()
        except GroupBroken as exc:
            self._break(exc)

    def _break(self, exc: GroupBroken) -> None:
        self.broken = exc
        log.error("worker group broken", error=str(exc))
        raise exc


def _is_error(result: Any) -> bool:
    try:
        raise_if_error(result)
    except Exception:
        return True
    return False


def take_expert_counts(engine: LLMEngine) -> list[list[int]] | None:
    """Tokens routed to each logical expert of each MoE layer by this rank since the last call, or None
    for a dense model."""
    counts = engine.expert_counts()
    return counts.tolist() if counts.numel() else None


def _add_counts(a: list[list[int]] | None, b: list[list[int]] | None) -> list[list[int]] | None:
    if a is None or b is None:
        return a if b is None else b
    return [[x + y for x, y in zip(la, lb)] for la, lb in zip(a, b)]
