"""The router's view of the mesh: a liveness table of service instances and the placement rules.

Pure: no sockets, no clock reads (callers pass `now`, Unix seconds). The router core owns the request
state machine; this module owns everything per instance — role, incarnation, heartbeat loads, which
router requests it holds, and the router's own load accounting on it — and answers "which tokenizer /
prefill worker / decode worker next".

Roles: "tokenizer", "prefill", "decode", and "worker" (prefill and decode co-located in one process:
a request placed on it is prefilled and decoded there). Other roles (kvcache, balancer, router) are
tracked for liveness but never placed on.

Liveness: an instance is placeable once it has sent a heartbeat, while its last heartbeat is at most
`heartbeat_timeout_s` old, it is not draining (as the router was told, or as its heartbeat says), and
`expire` has not declared it dead. `expire` declares dead an instance whose heartbeats stopped, or a worker
that reports queued or running work while its progress counter has not moved for `progress_timeout_s`
(wedged, not busy). A heartbeat with a new incarnation is a restart. Heartbeats from a retired incarnation,
or not newer than the last seq, are stale.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from deepinfer.protocol.messages import Heartbeat

TOKENIZER, PREFILL, DECODE, WORKER = "tokenizer", "prefill", "decode", "worker"
WORKER_ROLES = frozenset({PREFILL, DECODE, WORKER})
RETIRED_INCARNATIONS = 8  # old incarnations remembered per instance, to drop their late heartbeats


class Beat(enum.Enum):
    """What a heartbeat meant to the table."""

    NEW = "new"  # first heartbeat from this instance (or its first after Hello)
    UPDATED = "updated"
    REVIVED = "revived"  # same incarnation, after the table had declared it dead
    RESTARTED = "restarted"  # new incarnation (or role) of a known instance: its old requests are lost
    STALE = "stale"  # duplicate, reordered, or from a retired incarnation: ignored


@dataclass(eq=False)
class Instance:
    """One service process as the router sees it."""

    name: str
    role: str
    incarnation: str | None = None  # None until the first heartbeat
    seq: int = -1
    progress: int = 0
    last_heartbeat: float | None = None
    last_progress: float = 0.0  # when progress last advanced (or the instance reported no work)
    alive: bool = True  # False once `expire` declared it dead; a heartbeat may revive or restart it
    load: Heartbeat | None = None  # the latest heartbeat: free blocks, running batch, queued tokens, speculation
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=RETIRED_INCARNATIONS))
    held: set[str] = field(default_factory=set)  # router request ids this instance holds state for
    # The router's own accounting, updated the moment it sends work (heartbeats lag behind):
    prefill_tokens: int = 0  # prompt tokens of prefill jobs sent here and not yet done
    pending_blocks: int = 0  # KV blocks of requests headed here whose KV is not yet installed
    assigned: int = 0  # requests this router decodes here (placed or running)
    # Block hashes of the prompts being prefilled here (a count per hash): blocks this worker will hold in its
    # device pool once those prefills commit them. A request placed here meanwhile waits for them rather than
    # computing them again (the scheduler's in-flight dedupe), so they count as cached here (router_cache).
    computing: Counter[bytes] = field(default_factory=Counter)
    # The TPOT SLOs of the requests this router decodes here (a count per SLO): a new stream must not slow
    # the worker's tokens past the tightest of them (router_admission).
    tpot_slos: Counter[float] = field(default_factory=Counter)
    kvcache: str | None = None  # the cache daemon this worker reads from (its Hello's "kvcache" capability)
    pid: int | None = None  # its process id (the Hello's "pid" capability), as a supervisor names it
    # Draining (router_drain): set when an operator asks the router to drain it, or its heartbeat says so;
    # from then on it gets no new work. `drain_acked`: the router told it so, and it waits for the release.
    draining: bool = False
    drain_acked: bool = False
    restarts: int = 0  # new incarnations after its first, as this router saw them
    clock_offset_s: float | None = None  # its wall clock less the router's (ServiceStatus; nothing decides by it)

    def placeable(self, now: float, timeout_s: float) -> bool:
        return (
            self.alive
            and not self.draining
            and self.load is not None
            and not self.load.draining
            and self.last_heartbeat is not None
            and now - self.last_heartbeat <= timeout_s
        )

    @property
    def queued_tokens(self) -> int:
        # The heartbeat counts every router's jobs but lags; our own count is fresh but only ours.
        # The larger of the two is never an underestimate of either view.
        return max(self.load.queued_prompt_tokens if self.load else 0, self.prefill_tokens)

    @property
    def batch(self) -> int:
        reported = (self.load.running + self.load.waiting) if self.load else 0
        return max(reported, self.assigned)

    @property
    def tightest_tpot_slo(self) -> float | None:
        return min(self.tpot_slos, default=None)

    @property
    def free_blocks(self) -> int:
        return (self.load.free_blocks if self.load else 0) - self.pending_blocks

    @property
    def spec_acceptance_rate(self) -> float | None:
        """The worker's accepted / proposed draft tokens over its incarnation, from its latest heartbeat;
        None before it proposed any (it does not speculate, or has decoded nothing yet)."""
        if self.load is None or not self.load.spec_proposed_tokens:
            return None
        return self.load.spec_accepted_tokens / self.load.spec_proposed_tokens


@dataclass(frozen=True)
class Placement:
    prefill: Instance
    decode: Instance  # the same object as `prefill` for a co-located worker


@dataclass(eq=False)
class Assignment:
    """Which instances serve one router request, which of them hold state for it, and what it is
    charged on their loads. Changed only through InstanceTable, which keeps the invariant: an instance
    carries a request's charges only while it holds the request (so resetting a restarted instance,
    after its held requests are failed, never strands a charge)."""

    rid: str
    tokenizer: str  # encodes the prompt, then detokenizes the decode stream
    prefill: str | None = None
    decode: str | None = None
    holders: frozenset[str] = frozenset()
    prefill_tokens: int = 0  # charged on `prefill` until the prefill is over (the tokens it must compute)
    pending_blocks: int = 0  # charged on `decode` until the KV is installed there
    assigned: bool = False  # counted in `decode`'s batch until decoding is over
    computing: tuple[bytes, ...] = ()  # its prompt's block hashes, charged on `prefill` until the prefill is over
    tpot_slo: float | None = None  # charged on `decode` with `assigned`


class InstanceTable:
    """Instances by name, with liveness and placement."""

    def __init__(self, heartbeat_timeout_s: float, progress_timeout_s: float | None, block_size: int) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.block_size = block_size
        self.instances: dict[str, Instance] = {}
        self._rr = 0  # round-robin cursor over tokenizers

    def get(self, name: str) -> Instance | None:
        return self.instances.get(name)

    def hello(self, role: str, name: str, incarnation: str | None, now: float) -> Beat:
        """A peer connected. Registers it; it becomes placeable with its first heartbeat (which carries
        its load). A known instance saying Hello with another incarnation has restarted: on RESTARTED
        the caller fails its held requests and then calls `reset`. Without an incarnation, or with the
        same one, a Hello is a reconnect and changes nothing."""
        inst = self.instances.get(name)
        if inst is None:
            self.instances[name] = Instance(name, role, incarnation, last_progress=now)
            return Beat.NEW
        if incarnation is None or incarnation in inst.retired:
            return Beat.STALE if incarnation else Beat.UPDATED
        if inst.incarnation is not None and (incarnation != inst.incarnation or role != inst.role):
            return Beat.RESTARTED
        inst.incarnation = incarnation
        return Beat.UPDATED

    def heartbeat(self, hb: Heartbeat, now: float) -> Beat:
        """Record a heartbeat. On RESTARTED the caller must fail the instance's held requests and then
        call `reset`; until then the instance keeps its old incarnation's requests and accounting."""
        inst = self.instances.get(hb.instance)
        if inst is None:
            inst = self.instances[hb.instance] = Instance(hb.instance, hb.service, last_progress=now)
        if hb.incarnation in inst.retired:
            return Beat.STALE
        if inst.incarnation is not None and (hb.incarnation != inst.incarnation or hb.service != inst.role):
            return Beat.RESTARTED
        if inst.incarnation is not None and hb.seq <= inst.seq:
            return Beat.STALE
        verdict = Beat.NEW if inst.load is None else (Beat.UPDATED if inst.alive else Beat.REVIVED)
        self._apply(inst, hb, now)
        if verdict is Beat.REVIVED and self._wedged(inst, now):
            inst.alive = False  # heartbeats come from its I/O loop; its engine is still stuck
            return Beat.UPDATED
        return verdict

    def reset(self, name: str, role: str, incarnation: str, now: float, hb: Heartbeat | None = None) -> None:
        """Adopt the new incarnation of a restarted instance, once its old requests are failed. It is
        placeable again with a heartbeat from the new incarnation (`hb`, or the next one)."""
        inst = self.instances[name]
        if inst.incarnation is not None:
            inst.retired.append(inst.incarnation)
            inst.restarts += 1
        inst.role, inst.incarnation, inst.seq, inst.progress, inst.load = role, incarnation, -1, 0, None
        inst.held.clear()
        inst.prefill_tokens = inst.pending_blocks = inst.assigned = 0
        inst.computing.clear()
        inst.tpot_slos.clear()
        inst.alive, inst.last_progress = True, now
        inst.draining = inst.drain_acked = False  # a new process: the old one's drain is over
        if hb is not None:
            self._apply(inst, hb, now)

    def retire(self, inst: Instance) -> None:
        """Its process is known to be gone: dead now, and its incarnation's late heartbeats are stale. A
        new incarnation (a Hello or heartbeat) is then a restart, as usual."""
        if inst.incarnation is not None and inst.incarnation not in inst.retired:
            inst.retired.append(inst.incarnation)
        inst.alive = False

    def _apply(self, inst: Instance, hb: Heartbeat, now: float) -> None:
        if inst.load is None or hb.progress != inst.progress or hb.running + hb.waiting == 0:
            inst.last_progress = now
        inst.role, inst.incarnation, inst.seq, inst.progress = hb.service, hb.incarnation, hb.seq, hb.progress
        inst.last_heartbeat, inst.load, inst.alive = now, hb, True

    def expire(self, now: float) -> list[tuple[Instance, str]]:
        """Declare dead the instances that stopped heartbeating or progressing: (instance, why), each
        reported once (until a heartbeat revives it)."""
        dead = []
        for inst in self.instances.values():
            if not inst.alive or inst.last_heartbeat is None:
                continue
            silent = now - inst.last_heartbeat
            if silent > self.heartbeat_timeout_s:
                why = f"{inst.role} {inst.name} sent no heartbeat for {silent:.1f}s"
            elif self._wedged(inst, now):
                why = f"{inst.role} {inst.name} made no progress for {now - inst.last_progress:.1f}s"
            else:
                continue
            inst.alive = False
            dead.append((inst, why))
        return dead

    def _wedged(self, inst: Instance, now: float) -> bool:
        # Only workers: a tokenizer idles while its requests decode elsewhere.
        if self.progress_timeout_s is None or inst.role not in WORKER_ROLES or inst.load is None:
            return False
        has_work = inst.load.running + inst.load.waiting > 0
        return has_work and now - inst.last_progress > self.progress_timeout_s

    # ----- which instances hold a request, and its charges on them -----

    def hold(self, a: Assignment, names: Iterable[str | None]) -> None:
        """Make `names` the holders of `a`; an instance that stops holding it sheds its charges."""
        new = frozenset(n for n in names if n is not None)
        for name in a.holders - new:
            self.instances[name].held.discard(a.rid)
            if name == a.prefill:
                self.prefill_over(a)
            if name == a.decode:
                self.decode_over(a)
        for name in new - a.holders:
            self.instances[name].held.add(a.rid)
        a.holders = new

    def assign(
        self, a: Assignment, placement: Placement, prompt_tokens: int, compute_tokens: int | None = None,
        block_hashes: Sequence[bytes] = (), tpot_slo: float | None = None,
    ) -> None:
        """Send `a` to a placement: charge its loads now (heartbeats only show the work later). The prefill
        worker is charged `compute_tokens` (the prompt less its predicted cache hit; default the whole
        prompt) and the prompt's `block_hashes` as being computed there, the decode worker the blocks of the
        whole prompt and the request's `tpot_slo`."""
        self.hold(a, {a.tokenizer})  # sheds any earlier placement
        prefill, decode = placement.prefill, placement.decode
        a.prefill, a.decode = prefill.name, decode.name
        a.prefill_tokens = prompt_tokens if compute_tokens is None else compute_tokens
        a.computing = tuple(block_hashes)
        prefill.computing.update(a.computing)
        a.pending_blocks, a.assigned = self.blocks_for(prompt_tokens), True
        prefill.prefill_tokens += a.prefill_tokens
        decode.pending_blocks += a.pending_blocks
        decode.assigned += 1
        a.tpot_slo = tpot_slo
        if tpot_slo is not None:
            decode.tpot_slos[tpot_slo] += 1
        self.hold(a, {a.tokenizer, prefill.name, decode.name})

    def prefill_over(self, a: Assignment) -> None:
        """The prefill worker is done (PrefillDone) or dropped it: its tokens, and the KV in transit."""
        if a.prefill_tokens:
            self.instances[a.prefill].prefill_tokens -= a.prefill_tokens  # type: ignore[index]
            a.prefill_tokens = 0
        if a.computing:
            computing = self.instances[a.prefill].computing  # type: ignore[index]
            computing.subtract(a.computing)
            for h in a.computing:
                if computing[h] <= 0:
                    computing.pop(h, None)
            a.computing = ()
        self._installed(a)

    def decode_over(self, a: Assignment) -> None:
        self._installed(a)
        if a.assigned:
            decode = self.instances[a.decode]  # type: ignore[index]
            decode.assigned -= 1
            a.assigned = False
            if a.tpot_slo is not None:
                decode.tpot_slos[a.tpot_slo] -= 1
                if decode.tpot_slos[a.tpot_slo] <= 0:
                    del decode.tpot_slos[a.tpot_slo]
                a.tpot_slo = None

    def _installed(self, a: Assignment) -> None:
        if a.pending_blocks:
            self.instances[a.decode].pending_blocks -= a.pending_blocks  # type: ignore[index]
            a.pending_blocks = 0

    # ----- placement -----

    def _live(self, role: str, now: float, exclude: Iterable[str] = ()) -> list[Instance]:
        skip = set(exclude)
        return [
            i
            for i in self.instances.values()
            if i.role == role and i.name not in skip and i.placeable(now, self.heartbeat_timeout_s)
        ]

    def has_live(self, role: str, now: float) -> bool:
        return bool(self._live(role, now))

    def pick_tokenizer(self, now: float) -> Instance | None:
        """Round robin over live tokenizers, in name order (stable as instances come and go)."""
        live = sorted(self._live(TOKENIZER, now), key=lambda i: i.name)
        if not live:
            return None
        self._rr += 1
        return live[(self._rr - 1) % len(live)]

    def unservable(self, now: float) -> str | None:
        """Why a request sent now would not be placed at once — refused as "unavailable" (the router core's
        admission asks `place` and then for a tokenizer, in that order), or, within `placement_timeout_s` of a
        worker's loss, admitted to wait parked for one — or None when a tokenizer and a worker pair (or a
        co-located worker) would take it now. Readiness says not ready in both cases: a balancer should send
        the request elsewhere. Changes nothing: no round robin advances, nothing is held."""
        if self.place(1, 1, now) is None:
            return "no live prefill/decode workers"
        if not self.has_live(TOKENIZER, now):
            return "no live tokenizer"
        return None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def place(
        self,
        prompt_tokens: int,
        max_tokens: int,
        now: float,
        exclude: Iterable[str] = (),
        prefill_cost: Callable[[Instance], float] | None = None,
    ) -> Placement | None:
        """A prefill worker and a decode worker for a prompt, or None when nothing live can take it.

        `prefill_cost` ranks prefill-capable workers (lower is better); by default their queued prompt
        tokens (least loaded). Disaggregated pairs come first: the prefill worker of least cost, and the
        decode worker by `pick_decode`. Without a live pair, a co-located worker: among those with room
        for the whole sequence (or all, when none has), the least cost, then the smallest batch. Ties go
        to the lowest name, so placement is deterministic."""
        cost: Callable[[Instance], float] = prefill_cost or (lambda i: i.queued_tokens)
        exclude = set(exclude)
        need = self.blocks_for(prompt_tokens + max_tokens)
        prefills = self._live(PREFILL, now, exclude)
        decode = self.pick_decode(self._live(DECODE, now, exclude), need)
        if prefills and decode is not None:
            return Placement(min(prefills, key=lambda i: (cost(i), i.name)), decode)
        workers = self._live(WORKER, now, exclude)
        fits = [w for w in workers if w.free_blocks >= need] or workers
        if not fits:
            return None
        worker = min(fits, key=lambda i: (cost(i), i.batch, i.name))
        return Placement(worker, worker)

    @staticmethod
    def pick_decode(candidates: list[Instance], need_blocks: int) -> Instance | None:
        """Among decode workers with `need_blocks` free (prompt plus the whole output budget: no
        preemption needed), the smallest running batch — a decode step's cost grows with the batch,
        so this keeps time per output token lowest — then the most free blocks. When none has room,
        the most free blocks: the worker may still fit it by preempting, or refuse the reservation."""
        fits = [c for c in candidates if c.free_blocks >= need_blocks]
        if fits:
            return min(fits, key=lambda i: (i.batch, -i.free_blocks, i.name))
        return min(candidates, key=lambda i: (-i.free_blocks, i.batch, i.name), default=None)
