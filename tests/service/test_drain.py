"""Graceful drain between a real router and real `Service`s (no model), over ipc://: an operator's drain
takes the member out of placement at once, and the member stops only once the router released it (it holds
none of the member's requests), saying goodbye; at the drain's timeout what it still holds moves to another
member; a member drained by SIGTERM is acknowledged and released the same way; only a supervisor identity may
drain; and `deepinfer-launch drain` runs the whole conversation and waits for the successor.

Waits are bounded only so that a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from click.testing import CliRunner

from deepinfer.launch.cli import main
from deepinfer.launch.topology import Topology
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, asend_msg, make_dealer
from deepinfer.services.base import Service
from deepinfer.services.router import RouterService

WAIT_S = 30.0
_requests = itertools.count()


class Member(Service):
    """A model-less mesh member: it holds each EncodeRequest it gets until that is aborted; idle when it holds
    nothing (never, with `busy`)."""

    def __init__(self, name: str, backend: str, ctx: zmq.asyncio.Context, role: str = "tokenizer") -> None:
        super().__init__(name, backend, ctx, heartbeat_s=0.1)
        self.role = role  # type: ignore[misc]  # per instance, as a worker's
        self.holding: set[str] = set()
        self.encodes: list[m.EncodeRequest] = []
        self.busy = False
        self.released = asyncio.Event()

    def handlers(self) -> dict[type, Any]:
        return {m.EncodeRequest: self._encode, m.AbortRequest: self._abort}

    def idle(self) -> bool:
        return not self.holding and not self.busy

    async def _encode(self, req: m.EncodeRequest) -> None:
        self.encodes.append(req)
        self.holding.add(req.request_id)

    async def _abort(self, req: m.AbortRequest) -> None:
        self.holding.discard(req.request_id)

    async def _on_shutdown(self, msg: m.Shutdown) -> None:
        await super()._on_shutdown(msg)
        if not msg.drain and self.draining:
            self.released.set()


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {WAIT_S}s: {what}")


class Mesh:
    """A router and its members on one context; a client and an operator socket on it."""

    def __init__(self, ctx: zmq.asyncio.Context, frontend: str, backend: str) -> None:
        self.ctx, self.frontend, self.backend = ctx, frontend, backend
        self.router = RouterService("router", frontend, backend, ctx)
        self.tasks: dict[str, asyncio.Future[None]] = {"router": asyncio.ensure_future(self.router.run())}
        self.members: dict[str, Member] = {}
        self.client = make_dealer(ctx, frontend, b"client-1")
        self.operator = make_dealer(ctx, backend, b"supervisor-op")

    async def member(self, name: str, role: str = "tokenizer") -> Member:
        """A member running, once the router may place work on it."""
        svc = self.members[name] = Member(name, self.backend, self.ctx, role)
        self.tasks[name] = asyncio.ensure_future(svc.run())
        await until(lambda: self.router.drains.status(name, self.router._now()).serving, f"{name} serving")
        return svc

    def inst(self, name: str) -> Any:
        return self.router.core.table.get(name)

    async def generate(self) -> str:
        """A request from the client; its id."""
        rid = f"r{next(_requests)}"
        await asend_msg(self.client, m.GenerateRequest(rid, prompt_token_ids=[1, 2, 3], stream=True))
        return rid

    async def client_reply(self) -> Any:
        assert await self.client.poll(WAIT_S * 1000), "no reply to the client"
        return await arecv_msg(self.client)

    async def ask(self, msg: Any) -> m.ServiceStatus:
        await asend_msg(self.operator, msg)
        assert await self.operator.poll(WAIT_S * 1000), "no answer to the operator"
        reply = await arecv_msg(self.operator)
        assert isinstance(reply, m.ServiceStatus), reply
        return reply


@contextlib.asynccontextmanager
async def mesh_at(tmp: Path, frontend: str | None = None, backend: str | None = None) -> AsyncIterator[Mesh]:
    ctx = zmq.asyncio.Context()
    mesh = Mesh(ctx, frontend or f"ipc://{tmp}/front.sock", backend or f"ipc://{tmp}/back.sock")
    await asend_msg(mesh.client, m.Hello(m.PROTOCOL_VERSION, "client", "client-1"))
    assert (await mesh.client_reply()).accepted
    try:
        yield mesh
    finally:
        for svc in [*mesh.members.values(), mesh.router]:
            svc.stop()
        await asyncio.wait(list(mesh.tasks.values()), timeout=WAIT_S)
        mesh.client.close(linger=0)
        mesh.operator.close(linger=0)
        ctx.destroy(linger=0)


def test_an_operators_drain_takes_the_member_out_at_once_and_it_leaves_once_released(tmp_path):
    async def run() -> None:
        async with mesh_at(tmp_path) as mesh:
            await mesh.member("worker-0", role="worker")
            tok = await mesh.member("tok-a")
            rid = await mesh.generate()
            await until(lambda: len(tok.encodes) == 1, "the request held by the tokenizer")

            status = await mesh.ask(m.DrainService("tok-a", timeout_s=WAIT_S))
            assert status.known and status.alive and status.draining and not status.serving and status.held == 1
            assert status.pid == os.getpid() and status.role == "tokenizer"
            # No new work from the moment the router answered: with no other tokenizer it is refused.
            refused_id = await mesh.generate()
            refused = await mesh.client_reply()
            assert isinstance(refused, m.ErrorReply) and refused.request_id == refused_id
            assert refused.code == "unavailable"
            await until(lambda: tok.draining, "the member drains")
            assert mesh.tasks["tok-a"].done() is False  # it still holds the request: it waits
            # The request ends (its client aborts it): the router holds nothing of the member's, releases it,
            # and the member leaves, saying goodbye; no request moved.
            await asend_msg(mesh.client, m.AbortRequest(rid))
            aborted = await mesh.client_reply()
            assert isinstance(aborted, m.RequestFinished) and aborted.finish_reason == "abort"
            await asyncio.wait_for(mesh.tasks["tok-a"], WAIT_S)
            assert tok.released.is_set()
            await until(lambda: not mesh.inst("tok-a").alive, "the router retired it at its goodbye")
            drains = mesh.router.drains
            assert (drains.begun, drains.finished, drains.timed_out) == (1, 1, 0)
            assert not mesh.router.core.metrics.migrations
            gone = await mesh.ask(m.ServiceQuery("tok-a"))
            assert gone.known and not gone.alive and not gone.serving and gone.held == 0

    asyncio.run(run())


def test_what_a_member_still_holds_at_the_drain_timeout_moves_to_another(tmp_path):
    async def run() -> None:
        async with mesh_at(tmp_path) as mesh:
            await mesh.member("worker-0", role="worker")
            tok_a = await mesh.member("tok-a")
            rid = await mesh.generate()
            await until(lambda: len(tok_a.encodes) == 1, "the request held by tok-a")
            tok_b = await mesh.member("tok-b")
            tok_a.busy = True  # it would never finish by itself
            await mesh.ask(m.DrainService("tok-a", timeout_s=0.3))
            await asyncio.wait_for(mesh.tasks["tok-a"], WAIT_S)  # stopped at its deadline
            assert not tok_a.released.is_set()
            # Its goodbye moved the request to tok-b at once (a new id for the same client request).
            await until(lambda: len(tok_b.encodes) == 1, "the request moved to tok-b")
            assert tok_b.encodes[0].request_id.endswith("~1")
            assert mesh.router.core.request_of(b"client-1", rid).where.tokenizer == "tok-b"
            drains = mesh.router.drains
            assert (drains.begun, drains.finished, drains.timed_out) == (1, 1, 1)
            assert mesh.router.core.metrics.migrations == {"drain": 1}

    asyncio.run(run())


def test_a_member_draining_by_itself_is_acknowledged_then_released(tmp_path):
    async def run() -> None:
        async with mesh_at(tmp_path) as mesh:
            await mesh.member("worker-0", role="worker")
            tok = await mesh.member("tok-a")
            rid = await mesh.generate()
            await until(lambda: len(tok.encodes) == 1, "the request held by the tokenizer")
            tok.drain(timeout_s=WAIT_S)  # what its SIGTERM handler does
            await until(lambda: tok._drain_acked, "the router acknowledged the drain")
            assert mesh.inst("tok-a").draining and mesh.router.drains.begun == 1
            await asend_msg(mesh.client, m.AbortRequest(rid))
            await mesh.client_reply()
            await asyncio.wait_for(mesh.tasks["tok-a"], WAIT_S)
            assert tok.released.is_set()
            await until(lambda: mesh.router.drains.finished == 1, "its goodbye counted")

    asyncio.run(run())


def test_only_a_supervisor_may_drain_and_a_member_says_goodbye_only_for_itself(tmp_path):
    async def run() -> None:
        async with mesh_at(tmp_path) as mesh:
            await mesh.member("worker-0", role="worker")
            tok = await mesh.member("tok-a")
            intruder = mesh.members["worker-0"]
            forged = mesh.router.forged
            await intruder.send_router(m.ServiceExited("tok-a", os.getpid(), 0))  # ignored: not its own
            await intruder.send_router(m.DrainService("tok-a", timeout_s=0))
            # (One socket: once the drain was refused and counted, the goodbye before it was handled too.)
            await until(lambda: mesh.router.forged == forged + 1, "the drain refused and counted")
            status = await mesh.ask(m.ServiceQuery("tok-a"))
            assert status.alive and status.serving and not status.draining and not tok.draining
            unknown = await mesh.ask(m.DrainService("nobody"))
            assert not unknown.known and not unknown.alive

    asyncio.run(run())


def test_the_drain_command_waits_for_the_drain_and_for_the_successor(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    name = topo.tokenizers[0].name

    async def run() -> None:
        async with mesh_at(tmp_path, topo.frontend, topo.backend) as mesh:
            await mesh.member("worker-0", role="worker")
            tok = await mesh.member(name)
            rid = await mesh.generate()
            await until(lambda: len(tok.encodes) == 1, "the request held by the tokenizer")
            command = asyncio.ensure_future(asyncio.to_thread(
                CliRunner().invoke, main, ["drain", name, "--run-dir", str(tmp_path), "--serving"]))
            await until(lambda: tok.draining, "the member drains")
            await asend_msg(mesh.client, m.AbortRequest(rid))
            await mesh.client_reply()
            await asyncio.wait_for(mesh.tasks[name], WAIT_S)
            await until(lambda: not mesh.inst(name).alive, "the router retired it")
            assert not command.done()  # it waits for a successor
            successor = await mesh.member(name)  # as a supervisor restarts it
            result = await asyncio.wait_for(command, WAIT_S)
            assert result.exit_code == 0, result.output
            # (The services' log lines land in the same captured output: this process logs to it too.)
            lines = [line for line in result.output.splitlines() if " [" not in line]
            assert lines[0].startswith(f"draining {name} (pid {os.getpid()})") and "1 request(s) in flight" in lines[0]
            assert f"{name} drained: its process (pid {os.getpid()}) left" in lines
            assert lines[-1] == f"{name} serving again (pid {os.getpid()})"
            assert not successor.draining

    asyncio.run(run())


def test_the_drain_command_refuses_what_it_cannot_drain(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    for name, says in (("router", "drains on SIGTERM"), ("nobody", "the topology has no service 'nobody'")):
        result = CliRunner().invoke(main, ["drain", name, "--topology", str(path)])
        assert result.exit_code == 2 and says in result.output, result.output
    result = CliRunner().invoke(main, ["drain", "tokenizer-0"])
    assert result.exit_code == 2 and "--topology FILE or the --run-dir" in result.output
