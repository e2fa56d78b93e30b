"""A follower rank of a worker group: an engine-only process, no sockets to the mesh.

    deepinfer-launch service worker --topology F --name NAME --rank R    →    run_follower(topology, NAME, R, config)

It joins the group (rendezvous `ep_master`), loads the same model with the same engine settings as the
leader (its share of the threads), says Hello (what the leader checks is the same on every rank), then
serves rounds until told to stop:

    receive Round → receive install/import KV → [switch placement] → apply my commands → [engine.step()]
    → report → send exported KV (a handoff's, or cached blocks for the cache daemon)

Each command's result goes back in the report at its position; a command that raises answers with the
error (the leader raises it again as the engine's type) and the engine is left as the call left it.

Exit codes: 0 when the leader ended the group (its Round said stop); 1 when the group broke (a collective
failed or timed out: the leader or another rank is gone), or anything else went wrong. Either way the
supervisor restarts the whole group; a follower never outlives its leader by more than the channel timeout.
"""

from __future__ import annotations

import traceback
from typing import Any

import structlog
import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.engine.engine import LLMEngine
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.services.group.channel import ControlChannel, GroupBroken, join_group
from deepinfer.services.group.control import (
    Command,
    Hello,
    Op,
    Report,
    Round,
    decode_logprob,
    decode_params,
    engine_load,
    engine_stats,
    error_result,
    kv_from_meta,
    kv_in_meta,
    kv_meta,
)
from deepinfer.services.group.engine import build_engine, take_expert_counts

log = structlog.get_logger("deepinfer.follower")

EXIT_STOPPED = 0  # the leader ended the group
EXIT_BROKEN = 1  # the group broke, or this rank failed


class Follower:
    """Serves the leader's rounds on one engine (see the module docstring)."""

    def __init__(self, engine: LLMEngine, channel: ControlChannel) -> None:
        self.engine = engine
        self.channel = channel
        self.rank = channel.rank
        self._stage_error: str | None = None  # a STAGE this engine refused outright, until the next STAGE/UNSTAGE

    def hello(self) -> None:
        e = self.engine
        self.channel.report(Hello(self.rank, e.fingerprint, e.kv_spec.layout, e.cache_namespace.id,
                                  engine_load(e)).encode())

    def serve(self) -> int:
        """Serve rounds until the leader says stop (EXIT_STOPPED); GroupBroken propagates."""
        while True:
            rnd = Round.decode(self.channel.broadcast())
            if not self._serve_round(rnd):
                return EXIT_STOPPED

    def _serve_round(self, rnd: Round) -> bool:
        engine = self.engine
        mine = rnd.commands[self.rank] if rnd.commands else []
        # The leader sends install/import KV right after the round, in command order: take it all before applying.
        metas = {i: kv_in_meta(c) for i, c in enumerate(mine)}
        kvs = {i: self.channel.recv_kv(0, *kv_from_meta(meta)) for i, meta in metas.items() if meta is not None}
        if rnd.switch is not None:  # before the commands and the step, as on every rank (a failure breaks the group)
            engine.switch_placement(rnd.switch)
        exports: list[torch.Tensor] = []
        results = [self._apply(c, kvs.get(i), exports) for i, c in enumerate(mine)]
        expired = engine.expire_reservations()
        outputs = []
        if rnd.step:
            before = set(engine.reservations.ids)
            outputs = engine.step()
            expired += sorted(before - set(engine.reservations.ids))  # leases step() itself expired
        stored, evicted = engine.pool.drain_events()
        staged = [None, self._stage_error] if self._stage_error else list(engine.staged_placement())
        report = Report(results, outputs, stored, evicted, expired, engine_load(engine), engine_stats(engine),
                        staged)
        self.channel.report(report.encode())
        for kv in exports:
            self.channel.send_kv(kv, 0)
        return not rnd.stop

    def _apply(self, command: Command, kv: torch.Tensor | None, exports: list[torch.Tensor]) -> Any:
        e = self.engine
        op, args = command[0], command[1:]
        try:
            match op:
                case Op.ADD:
                    rid, prompt, params, priority, prefill_only, salt, resumed = args
                    e.add_request(rid, prompt, decode_params(params), priority, prefill_only=prefill_only,
                                  cache_salt=salt, resume_output_ids=resumed)
                    return None
                case Op.ABORT:
                    return e.abort(args[0])
                case Op.RELEASE:
                    return e.release(args[0])
                case Op.CANCEL:
                    return e.cancel_reservation(args[0])
                case Op.RESERVE:
                    return e.reserve(args[0], args[1], args[2])
                case Op.EXPORT:
                    exported = e.export_kv(args[0])
                    exports.append(exported)
                    return kv_meta(exported)
                case Op.INSTALL:
                    rid, prompt, first, params, _, reservation, priority, first_lp, salt, resumed = args
                    assert kv is not None
                    e.add_prefilled_request(rid, prompt, first, decode_params(params), kv, reservation, priority,
                                            decode_logprob(first_lp), salt, resumed)
                    return None
                case Op.EXPERT_LOAD:
                    return [take_expert_counts(e), e.expert_computed()]
                case Op.IMPORT_CACHED:
                    hashes, tier, keep_resident, _ = args
                    assert kv is not None
                    return e.import_cached_blocks(hashes, kv, tier, keep_resident)
                case Op.EXPORT_CACHED:
                    names, blocks = e.export_cached_blocks(args[0])
                    if blocks is None:
                        return [names, None]
                    exports.append(blocks)
                    return [names, kv_meta(blocks)]
                case Op.RESET_CACHE:
                    return e.reset_prefix_cache()
                case Op.STAGE:
                    self._stage_error = None
                    try:
                        e.stage_placement(ExpertPlacement.from_dict(args[0]))
                    except Exception as exc:  # the leader learns it from the report's staged state
                        self._stage_error = f"rank {self.rank} refused the placement: {exc}"
                        raise
                    return None
                case Op.UNSTAGE:
                    self._stage_error = None
                    e.drop_staged_placement()
                    return None
                case _:
                    raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # the leader raises it again, as the engine's own type
            return error_result(exc)


def follow(channel: ControlChannel, engine: LLMEngine) -> int:
    """Serve the group on `engine` until it ends, then leave it; the exit code (see `run_follower`)."""
    rank = channel.rank
    try:
        follower = Follower(engine, channel)
        follower.hello()
        log.info("follower serving", rank=rank)
        code = follower.serve()
        log.info("follower stopped by its leader", rank=rank)
        return code
    except GroupBroken as exc:
        log.error("worker group broken", rank=rank, error=str(exc))
        return EXIT_BROKEN
    except Exception:
        log.error("follower failed", rank=rank, error=traceback.format_exc())
        return EXIT_BROKEN
    finally:
        engine.stop_staging()  # no loading thread may outlive the interpreter (it would abort the exit)
        channel.close()


def run_follower(topology: Any, name: str, rank: int, config: EngineConfig) -> int:
    """Run rank `rank` (1..ep-1) of worker `name` of `topology` with this rank's engine settings (the
    launcher's `engine_config` for the rank) until the group ends; the process exit code: EXIT_STOPPED (0)
    when the leader ended the group, EXIT_BROKEN (1) when it broke or this rank failed (a bad rank or
    topology included)."""
    try:
        spec = topology.worker(name)
        if not 1 <= rank < spec.ep:
            raise ValueError(f"rank {rank} is not a follower rank of worker {name!r} (ep = {spec.ep})")
        channel, ep_group = join_group(spec.ep, rank, spec.ep_master, config.device, config.ep_timeout_s)
    except Exception:
        log.error("follower could not join its group", worker=name, rank=rank, error=traceback.format_exc())
        return EXIT_BROKEN
    try:
        engine = build_engine(topology.model, config, ep_group)
    except Exception:
        log.error("follower could not load its engine", worker=name, rank=rank, error=traceback.format_exc())
        channel.close()  # the leader, waiting for this rank's Hello, sees the group break
        return EXIT_BROKEN
    return follow(channel, engine)
