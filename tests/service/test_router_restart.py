"""A router that restarted knows no one: it asks every service that speaks to it for a Hello, and the
services drop the old router's work and say Hello again. Also: the router takes a message about an
instance only from that instance's own socket. Real ZeroMQ sockets over ipc://, no model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.protocol.handshake import SAY_HELLO
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer
from deepinfer.services.base import Service
from deepinfer.services.router import RouterService


class Recording(Service):
    """A model-less service that remembers when it was told the router restarted."""

    role = "tokenizer"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.restarts_seen = 0

    async def on_router_restart(self) -> None:
        self.restarts_seen += 1


async def until(check, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def start_router(ctx: zmq.asyncio.Context, tmp: Path, name: str = "router") -> tuple[RouterService, asyncio.Future]:
    router = RouterService(name, f"ipc://{tmp}/front.sock", f"ipc://{tmp}/back.sock", ctx)
    return router, asyncio.ensure_future(router.run())


@contextlib.asynccontextmanager
async def running_router(tmp: Path) -> AsyncIterator[tuple[zmq.asyncio.Context, RouterService]]:
    """A context and a router serving on it, both gone afterwards."""
    ctx = zmq.asyncio.Context()
    router, task = start_router(ctx, tmp)
    try:
        yield ctx, router
    finally:
        router.stop()
        await task
        ctx.destroy(linger=0)


async def registered(ctx: zmq.asyncio.Context, router: RouterService, tmp: Path,
                     name: str) -> tuple[Recording, asyncio.Future]:
    """A Recording service running, once the router has its Hello."""
    svc = Recording(name, f"ipc://{tmp}/back.sock", ctx, heartbeat_s=0.1)
    task = asyncio.ensure_future(svc.run())
    await until(lambda: router.core.table.get(name) is not None)
    return svc, task


def test_services_say_hello_again_to_a_restarted_router(tmp_path):
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        router, task = start_router(ctx, tmp_path)
        svc = Recording("tok-a", f"ipc://{tmp_path}/back.sock", ctx, heartbeat_s=0.1, model_fingerprint="fp-1",
                        block_hash_scheme="scheme-1")
        svc_task = asyncio.ensure_future(svc.run())
        await until(lambda: "tok-a" in router.core.table.instances and router.core.table.get("tok-a").load)
        assert svc.restarts_seen == 0
        router.stop()
        await task
        # A new router on the same endpoints: it pinned nothing and knows no instance.
        router2, task2 = start_router(ctx, tmp_path)
        assert router2.pins.fingerprint is None
        await until(lambda: router2.core.table.get("tok-a") is not None and router2.core.table.get("tok-a").load)
        assert svc.restarts_seen == 1  # its old work was dropped, once
        assert router2.pins.fingerprint == "fp-1" and router2.pins.scheme == "scheme-1"  # pins restored
        assert router2.core.table.get("tok-a").pid is not None
        svc.stop()
        await svc_task
        router2.stop()
        await task2
        ctx.destroy(linger=0)

    asyncio.run(run())


def test_router_asks_unknown_senders_for_hello_and_refuses_messages_for_others(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router):
            peer = make_dealer(ctx, f"ipc://{tmp_path}/back.sock", b"dec-x")

            async def reply() -> Any:
                assert await peer.poll(5000)
                return await arecv_msg(peer)

            beat = m.Heartbeat("decode", "dec-x", "inc", 1, 1)
            await asend_msg(peer, beat)
            ask = await reply()
            assert isinstance(ask, m.Welcome) and not ask.accepted and ask.reason == SAY_HELLO
            assert router.core.table.get("dec-x") is None  # the heartbeat was dropped
            # A Hello naming another instance than its socket is refused.
            await asend_msg(peer, m.Hello(m.PROTOCOL_VERSION, "decode", "dec-y", capabilities={"incarnation": "inc"}))
            refused = await reply()
            assert not refused.accepted and "dec-y" in refused.reason
            await asend_msg(peer, m.Hello(m.PROTOCOL_VERSION, "decode", "dec-x", capabilities={"incarnation": "inc"}))
            assert (await reply()).accepted
            await asend_msg(peer, beat)
            await until(lambda: router.core.table.get("dec-x") is not None and router.core.table.get("dec-x").load)
            # A welcomed peer still speaks only for itself: a heartbeat in another's name is refused and counted.
            await asend_msg(peer, m.Heartbeat("decode", "dec-z", "inc", 1, 1))
            await until(lambda: router.forged == 1)
            assert router.core.table.get("dec-z") is None
            peer.close(linger=0)

    asyncio.run(run())


def test_a_refusal_other_than_say_hello_stops_the_service(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router):
            svc, svc_task = await registered(ctx, router, tmp_path, "tok-b")
            refusal = m.Welcome(m.PROTOCOL_VERSION, False, "model fingerprint mismatch")
            await asend_msg(router.backend, refusal, b"tok-b")
            await asyncio.wait_for(svc_task, 20)  # it stopped by itself
            assert svc.restarts_seen == 0

    asyncio.run(run())


def test_spawned_tasks_are_kept_logged_when_they_fail_and_cancelled_at_stop(tmp_path):
    async def run() -> None:
        async with running_router(tmp_path) as (ctx, router):
            svc, svc_task = await registered(ctx, router, tmp_path, "tok-c")

            async def fail() -> None:
                raise RuntimeError("boom")

            failing = svc.spawn(fail(), "failing")
            forever = svc.spawn(asyncio.sleep(3600), "sleeper")
            await until(lambda: failing.done())
            assert failing not in svc._spawned and forever in svc._spawned  # kept until done, then dropped
            svc.stop()
            await svc_task
            await until(lambda: forever.done())
            assert forever.cancelled()
            await until(lambda: not svc._spawned)

    asyncio.run(run())
