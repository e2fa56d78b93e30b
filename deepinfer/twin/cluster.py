"""The cluster twin: the real `RouterCore` deciding every admission and placement, simulated tokenizer,
workers and cache daemon around it, all on one virtual clock.

    twin = ClusterTwin(TwinConfig(...), costs)
    rows = twin.replay([(arrival_s, prompt_token_ids, max_tokens), ...], warm=[...])

Every message between services is delivered one hop later (`CostModel.hop`), in the order it was sent;
the router's shell work — ticks every TICK_S, turning client messages into core events, sending the core's
`Outbound`s — is done here with the router's own constants. Clients send each request at its arrival, as
bench/bench_replay.py does, and a row per request records what bench_replay records (so its `summarize` turns
twin rows and real rows into the same JSON).

The tokenizer is a stand-in: prompts come as token ids, so it only hashes them (the real chain hash,
`hash_blocks`, under the workers' namespace) and passes decode workers' tokens on as text deltas (text "").

What is real and what is a cost model is listed in the package docstring (deepinfer/twin/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.cache.hashing import CacheNamespace, HashKeys, hash_blocks
from deepinfer.protocol import messages as m
from deepinfer.services.router import TICK_S
from deepinfer.services.router_core import RouterConfig, RouterCore
from deepinfer.twin.cache import SimCacheDaemon
from deepinfer.twin.costs import CostModel
from deepinfer.twin.events import EventLoop
from deepinfer.twin.worker import SimWorker, WorkerSettings

__all__ = ["ClusterTwin", "TwinConfig", "TwinRequest", "twin_namespace"]

TOKENIZER = "tokenizer-0"
KVCACHE = "kvcache-0"
CLIENT = b"client-0"


def twin_namespace(block_size: int, model: str = "twin") -> CacheNamespace:
    """The namespace the twin's blocks are hashed under (any fixed one: only equality of hashes matters)."""
    return CacheNamespace(model, model, "float32", f"twin,block_size={block_size}", block_size)


@dataclass(frozen=True)
class TwinRequest:
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    index: int = 0


@dataclass(frozen=True)
class TwinConfig:
    """One mesh: `num_workers` co-located workers (the only layout the twin has yet), an optional cache daemon
    with its host and disk capacities in bytes, and the router's settings (the real RouterConfig)."""

    worker: WorkerSettings
    num_workers: int = 1
    router: RouterConfig = field(default_factory=RouterConfig)
    kvcache: bool = True
    host_cache_bytes: int = 256 << 20
    disk_cache_bytes: int = 2048 << 20
    disk_root: Path | None = None
    timeout_s: float = 1800.0  # client wait per request, as bench_replay's --timeout-s


class _Tokenizer:
    """Encode = hash the given token ids; detokenize = pass the tokens on. Heartbeats like any service."""

    def __init__(self, twin: ClusterTwin) -> None:
        self.twin = twin
        self._seq = 0

    def start(self) -> None:
        t = self.twin
        t.send(TOKENIZER, "router", m.Hello(m.PROTOCOL_VERSION, "tokenizer", TOKENIZER,
                                           capabilities={"incarnation": f"{TOKENIZER}-twin"}))
        self._heartbeat()

    def _heartbeat(self) -> None:
        self._seq += 1
        self.twin.send(TOKENIZER, "router", m.Heartbeat("tokenizer", TOKENIZER, f"{TOKENIZER}-twin", self._seq, 0))
        self.twin.loop.after(0.5, self._heartbeat)

    def receive(self, msg: Any) -> None:
        t = self.twin
        if isinstance(msg, m.EncodeRequest):
            ids = list(msg.prompt_token_ids or []) + list(msg.resume_output_ids or [])
            hashes = hash_blocks(t.namespace, ids, HashKeys(msg.cache_salt))
            t.send(TOKENIZER, "router", m.EncodeResult(msg.request_id, ids, hashes))
        elif isinstance(msg, m.DetokenizeBatch):
            items = [m.TextDeltaItem(i.request_id, i.offset, "", list(i.token_ids), i.finished, i.finish_reason,
                                     spec_proposed_tokens=i.spec_proposed_tokens,
                                     spec_accepted_tokens=i.spec_accepted_tokens) for i in msg.items]
            t.send(TOKENIZER, "router", m.TextDeltas(TOKENIZER, items, worker=msg.worker))
        elif not isinstance(msg, m.AbortRequest):
            raise TypeError(f"the twin's tokenizer takes no {type(msg).__name__}")


class ClusterTwin:
    def __init__(self, config: TwinConfig, costs: CostModel, router_core: type[RouterCore] = RouterCore) -> None:
        """`router_core`: the class deciding (RouterCore; a test passes a subclass to change a policy)."""
        self.config, self.costs = config, costs
        self.loop = EventLoop()
        self.namespace = twin_namespace(config.worker.block_size)
        self.router = router_core(config.router)
        self.tokenizer = _Tokenizer(self)
        self.daemon = (SimCacheDaemon(KVCACHE, self.loop, self.send, costs, self.namespace.id,
                                      config.worker.real_block_nbytes, config.host_cache_bytes,
                                      config.disk_cache_bytes, config.disk_root) if config.kvcache else None)
        self.workers = {f"worker-{i}": SimWorker(f"worker-{i}", self.loop, self.send, costs, config.worker,
                                                 self.namespace, self.daemon) for i in range(config.num_workers)}
        self._services: dict[str, Any] = {TOKENIZER: self.tokenizer, **self.workers}
        if self.daemon is not None:
            self._services[KVCACHE] = self.daemon
        self._pending: dict[str, dict[str, Any]] = {}  # client request id → its row, until it ends
        self.rows: list[dict[str, Any]] = []
        self.messages = 0
        self._started = False

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()

    # -- the wire -----------------------------------------------------------------------------------

    def send(self, sender: str, dest: str, msg: Any) -> None:
        """Deliver `msg` one hop from now (messages between a pair keep their order: equal delays, FIFO ties)."""
        self.messages += 1
        self.loop.after(self.costs.hop.seconds(), lambda: self._deliver(sender, dest, msg))

    def _deliver(self, sender: str, dest: str, msg: Any) -> None:
        if dest == "router":
            self._router_event(sender, msg)
        else:
            self._services[dest].receive(msg)

    def _router_event(self, sender: str, msg: Any) -> None:
        r, now = self.router, self.loop.now
        if isinstance(msg, m.GenerateRequest):
            out = r.on_generate(CLIENT, msg, now)
        elif isinstance(msg, m.Hello):
            out = r.on_hello(msg, now)
        elif isinstance(msg, m.Heartbeat):
            out = r.on_heartbeat(msg, now)
        elif isinstance(msg, m.EncodeResult):
            out = r.on_encode_result(sender, msg, now)
        elif isinstance(msg, m.KvEvents):
            out = r.on_kv_events(sender, msg, now)
        elif isinstance(msg, m.PrefillDone):
            out = r.on_prefill_done(msg, now)
        elif isinstance(msg, m.TextDeltas):
            out = r.on_text_deltas(sender, msg, now)
        elif isinstance(msg, m.ErrorReply):
            out = r.on_error(sender, msg, now)
        else:
            raise TypeError(f"the twin's router takes no {type(msg).__name__} from {sender}")
        self._router_send(out)

    def _router_send(self, out: Sequence[Any]) -> None:
        for o in out:
            if isinstance(o.dest, bytes):
                self.messages += 1
                self.loop.after(self.costs.hop.seconds(), lambda msg=o.msg: self._to_client(msg))
            else:
                self.send("router", o.dest, o.msg)

    def _tick(self) -> None:
        self._router_send(self.router.tick(self.loop.now))
        self.loop.after(TICK_S, self._tick)

    # -- clients ------------------------------------------------------------------------------------

    def _to_client(self, msg: Any) -> None:
        if isinstance(msg, m.StreamDelta):
            return
        row = self._pending.pop(msg.request_id)
        if isinstance(msg, m.ErrorReply):
            row.update(error=msg.code, message=msg.message)
        else:
            u, t = msg.usage, msg.timings
            row.update(completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                       cached_by_tier=dict(u.cached_by_tier), ttft_s=t.ttft_s, e2e_s=t.e2e_s, queue_s=t.queue_s,
                       prefill_s=t.prefill_s)
        row["finished_s"] = self.loop.now - self._t0
        if row.get("index", -1) >= 0:
            self.rows.append(row)

    def _submit(self, rid: str, prompt: Sequence[int], max_tokens: int, row: dict[str, Any]) -> None:
        self._pending[rid] = row
        params = m.SamplingParamsWire(max_tokens=max_tokens, ignore_eos=True)
        req = m.GenerateRequest(rid, prompt_token_ids=list(prompt), params=params, timeout_s=self.config.timeout_s)
        self.messages += 1
        self.loop.after(self.costs.hop.seconds(), lambda: self._router_event("client", req))

    # -- a run --------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._t0 = 0.0
        for svc in self._services.values():
            svc.start()
        self.loop.after(TICK_S, self._tick)
        self.loop.run(until=1.0)  # every service registered and heartbeating, as a mesh is once `up` returns

    def replay(self, requests: Sequence[TwinRequest], warm: Sequence[Sequence[int]] = ()) -> list[dict[str, Any]]:
        """Send `warm` (max_tokens 2, all at once, waited for), then each request at its arrival (seconds from
        the first); returns one row per request, bench_replay's shape, times from the first arrival."""
        self.start()
        for i, p in enumerate(warm):
            self._submit(f"warm-{i}", p, 2, {"index": -1})
        self.loop.run(stop=lambda: not self._pending)
        self._t0 = t0 = self.loop.now
        for r in requests:
            row = {"index": r.index, "arrival_s": r.arrival_s, "late_s": 0.0, "prompt_tokens": len(r.prompt),
                   "max_tokens": r.max_tokens}
            self.loop.at(t0 + r.arrival_s,
                         lambda r=r, row=row: self._submit(f"r{r.index}", r.prompt, r.max_tokens, row))
        left = len(requests)
        self.loop.run(stop=lambda: len(self.rows) >= left)
        return sorted(self.rows, key=lambda row: row["index"])
