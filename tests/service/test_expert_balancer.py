"""The expert balancer in a real router mesh (ZeroMQ over ipc://, no model): a fake worker group — a DEALER
speaking the protocol — reports skewed expert loads with the table it runs; the router keeps its rank
loads and relays the reports to the balancer, the balancer's PlacementUpdate to the worker and the
worker's PlacementResult back. The balancer adopts on ok, abandons on a refusal and on a timeout, and a
restarted balancer resumes from the reported table. The router refuses updates and results that do not
come from whom they must."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import zmq.asyncio

from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer
from deepinfer.services.balancer import BalancerConfig, BalancerService, placement_of, table_of
from deepinfer.services.router import RouterService
from tests.service.test_router_restart import running_router, until

LAYERS, EXPERTS, RANKS, REDUNDANT = 2, 8, 2, 2
STATIC = ExpertPlacement.static(LAYERS, EXPERTS, RANKS, REDUNDANT)
# Experts 0 and 1 are hot; under the static table rank 0 holds 1 and half of 0, so it does most of the work.
SKEWED = [[400, 300, 10, 10, 10, 10, 10, 10]] * LAYERS
GUARD_S = 20.0  # a guard against hangs only: nothing here is timed


class FakeGroup:
    """Rank 0 of a worker group, reduced to its messages: a DEALER named `name` on the router's backend."""

    def __init__(self, ctx: zmq.asyncio.Context, backend: str, name: str, role: str = "worker") -> None:
        self.name, self.role = name, role
        self.sock = make_dealer(ctx, backend, name.encode())

    async def hello(self) -> None:
        await self.send(m.Hello(m.PROTOCOL_VERSION, self.role, self.name, capabilities={"incarnation": self.name}))
        welcome = await self.next(m.Welcome)
        assert welcome.accepted, welcome.reason

    async def send(self, msg: Any) -> None:
        await asyncio.wait_for(asend_msg(self.sock, msg), GUARD_S)

    async def next(self, kind: type) -> Any:
        """The next message of type `kind` (the router's other messages skipped)."""
        while True:
            msg = await asyncio.wait_for(arecv_msg(self.sock), GUARD_S)
            if isinstance(msg, kind):
                return msg

    async def report(self, table: ExpertPlacement, loads: list[list[int]] = SKEWED) -> None:
        ranks = [round(sum(r)) for r in zip(*_rank_loads(table, loads), strict=True)]
        await self.send(m.ExpertLoad(self.name, table.version, 1.0, loads, ranks, table_of(table)))

    async def received(self) -> list[type]:
        """The types of what has arrived and is not read yet."""
        kinds = []
        while await self.sock.poll(0):
            kinds.append(type(await arecv_msg(self.sock)))
        return kinds

    def close(self) -> None:
        self.sock.close(linger=0)


def _rank_loads(table: ExpertPlacement, loads: list[list[int]]) -> list[list[float]]:
    from deepinfer.services.balancer_placement import rank_loads

    return rank_loads(table, loads)


CONFIG = BalancerConfig(interval_s=0.1, window_s=60.0, threshold=0.05, move_timeout_s=GUARD_S * 3)


@contextlib.asynccontextmanager
async def balancer_running(ctx: zmq.asyncio.Context, router: RouterService, tmp: Path,
                           config: BalancerConfig = CONFIG) -> AsyncIterator[BalancerService]:
    balancer = BalancerService("balancer", f"ipc://{tmp}/back.sock", ctx, config=config, heartbeat_s=0.1)
    task = asyncio.ensure_future(balancer.run())
    try:
        # Welcomed: this incarnation (not a predecessor of the same name) is the router's balancer.
        await until(lambda: router.balancer == b"balancer" and getattr(router.core.table.get("balancer"),
                                                                        "incarnation", None) == balancer.incarnation)
        yield balancer
    finally:
        balancer.stop()
        await task


@contextlib.asynccontextmanager
async def group(ctx: zmq.asyncio.Context, tmp: Path, name: str = "worker-0") -> AsyncIterator[FakeGroup]:
    g = FakeGroup(ctx, f"ipc://{tmp}/back.sock", name)
    try:
        await g.hello()
        yield g
    finally:
        g.close()


def _check_update(update: m.PlacementUpdate, version: int) -> ExpertPlacement:
    """The update is for worker-0, one version up, valid, and predicts a lower max/mean."""
    assert update.worker == "worker-0"
    new = placement_of(update.placement)
    assert new.version == version and new.layers != STATIC.layers
    assert len(update.before) == len(update.after) == LAYERS
    assert max(update.after) < max(update.before)
    return new


def test_the_balancer_moves_hot_experts_and_adopts_on_ok(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router), balancer_running(ctx, router, tmp_path) as bal, \
                group(ctx, tmp_path) as worker:
            await worker.report(STATIC)
            update = await worker.next(m.PlacementUpdate)
            status = router.expert_status()["worker-0"]  # kept by the router as it relayed the report
            assert status.placement_version == 0 and status.max_over_mean > 1.3
            new = _check_update(update, 1)
            assert bal.groups["worker-0"].core.pending == new
            await worker.send(m.PlacementResult("worker-0", 1, True))
            await until(lambda: bal.adopted == 1)
            core = bal.groups["worker-0"].core
            assert core.current == new and core.pending is None and bal.abandoned == 0
            # The group's next report shows the new table: nothing changes, and the router sees the version.
            await worker.report(new)
            await until(lambda: router.expert_status()["worker-0"].placement_version == 1)
            assert bal.groups["worker-0"].core.current == new

    asyncio.run(run())


def test_a_refused_placement_is_abandoned_and_the_next_gets_a_new_version(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router), balancer_running(ctx, router, tmp_path) as bal, \
                group(ctx, tmp_path) as worker:
            await worker.report(STATIC)
            _check_update(await worker.next(m.PlacementUpdate), 1)
            await worker.send(m.PlacementResult("worker-0", 1, False, "a move is in flight"))
            await until(lambda: bal.abandoned == 1)
            assert bal.groups["worker-0"].core.current == STATIC
            _check_update(await worker.next(m.PlacementUpdate), 2)  # the refused version is never reused

    asyncio.run(run())


def test_an_unanswered_placement_is_abandoned_at_its_timeout(tmp_path):
    async def run() -> None:
        config = dataclasses.replace(CONFIG, move_timeout_s=0.2)
        async with running_router(tmp_path) as (ctx, router), balancer_running(ctx, router, tmp_path, config) as bal, \
                group(ctx, tmp_path) as worker:
            await worker.report(STATIC)
            _check_update(await worker.next(m.PlacementUpdate), 1)
            await until(lambda: bal.abandoned == 1)
            assert bal.groups["worker-0"].core.current == STATIC
            _check_update(await worker.next(m.PlacementUpdate), 2)
            # A late answer to the abandoned decision changes nothing.
            await worker.send(m.PlacementResult("worker-0", 1, True))
            await worker.send(m.PlacementResult("worker-0", 2, True))
            await until(lambda: bal.adopted == 1)
            assert bal.groups["worker-0"].core.current.version == 2

    asyncio.run(run())


def test_a_restarted_balancer_resumes_from_the_reported_table(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router), group(ctx, tmp_path) as worker:
            async with balancer_running(ctx, router, tmp_path):
                await worker.report(STATIC)
                first = _check_update(await worker.next(m.PlacementUpdate), 1)
                await worker.send(m.PlacementResult("worker-0", 1, True))
            # The group moved on meanwhile (it runs version 3 of the static layout, say); the new balancer
            # knows nothing but what the group reports.
            running = dataclasses.replace(STATIC, version=3)
            async with balancer_running(ctx, router, tmp_path) as bal:
                assert not bal.groups
                await worker.report(running)
                await until(lambda: "worker-0" in bal.groups)
                assert bal.groups["worker-0"].core.current == running
                update = await worker.next(m.PlacementUpdate)
                assert _check_update(update, 4).layers  # above the reported version, never a stale one
                assert first.version < 4

    asyncio.run(run())


def test_a_group_that_restarted_on_an_older_table_starts_a_fresh_core(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router), balancer_running(ctx, router, tmp_path) as bal, \
                group(ctx, tmp_path) as worker:
            await worker.report(dataclasses.replace(STATIC, version=5))
            _check_update(await worker.next(m.PlacementUpdate), 6)
            await worker.report(STATIC)  # the group restarted: version 0 again, the decision is moot
            await until(lambda: bal.groups["worker-0"].core.current == STATIC)
            assert bal.groups["worker-0"].core.pending is None or bal.groups["worker-0"].core.pending.version == 1
            _check_update(await worker.next(m.PlacementUpdate), 1)

    asyncio.run(run())


def test_the_router_refuses_updates_and_results_from_the_wrong_sender(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router), group(ctx, tmp_path) as worker, \
                group(ctx, tmp_path, "worker-1") as other:
            table = table_of(STATIC)
            await other.send(m.PlacementUpdate("worker-0", table))  # a worker posing as the balancer
            await until(lambda: router.forged == 1)
            async with balancer_running(ctx, router, tmp_path) as bal:
                await other.send(m.PlacementUpdate("worker-0", table))  # still not the balancer
                await until(lambda: router.forged == 2)
                await other.send(m.PlacementResult("worker-0", 1, True))  # a result about another worker
                await until(lambda: router.forged == 3)
                assert m.PlacementUpdate not in await worker.received()  # refused, not relayed
                assert bal.progress == 0  # nothing reached the balancer
            # With no balancer, reports are still kept by the router.
            await worker.report(STATIC)
            await until(lambda: "worker-0" in router.expert_status())

    asyncio.run(run())


def test_only_the_balancer_instance_may_take_the_balancer_role(tmp_path):
    """A service saying Hello as "balancer" under another name (here a tokenizer's) is refused, so it
    receives no group's loads and cannot move experts; nor may another role use the balancer's name."""

    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router), group(ctx, tmp_path) as worker:
            for name, role in (("tokenizer-9", "balancer"), ("balancer", "tokenizer")):
                impostor = FakeGroup(ctx, f"ipc://{tmp_path}/back.sock", name, role=role)
                try:
                    await impostor.send(m.Hello(m.PROTOCOL_VERSION, role, name, capabilities={"incarnation": name}))
                    welcome = await impostor.next(m.Welcome)
                    assert not welcome.accepted and "balancer" in welcome.reason
                finally:
                    impostor.sock.close(linger=0)
            assert router.balancer is None
            await worker.report(STATIC)  # kept by the router, relayed to no one
            await until(lambda: "worker-0" in router.expert_status())
            async with balancer_running(ctx, router, tmp_path):  # the real one is still welcomed
                await worker.report(STATIC)
                assert isinstance(await worker.next(m.PlacementUpdate), m.PlacementUpdate)

    asyncio.run(run())
