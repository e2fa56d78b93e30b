"""Readiness, "a request sent now is served" (issue 38): the instance table's answer (pure), the router's answer
to a client's MeshQuery over in-process sockets as members join and as it drains, the gateway's RouterPool
asking it (concurrent probes share one question), and /ready and /health over it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq.asyncio
from starlette.testclient import TestClient

from deepinfer.gateway.app import Gateway, build_app
from deepinfer.gateway.router_pool import RouterPool
from deepinfer.protocol import messages as m
from deepinfer.protocol.client import AsyncClient, MeshError
from deepinfer.protocol.sockets import asend_msg, make_dealer
from deepinfer.services.router import RouterService
from deepinfer.services.router_core import RouterConfig
from deepinfer.services.router_placement import DECODE, PREFILL, TOKENIZER, WORKER, InstanceTable

NOW = 1000.0
WAIT_S = 60.0  # a bound that fails a regression instead of hanging; nothing asserts on wall time


def join(table: InstanceTable, role: str, name: str, draining: bool = False) -> None:
    table.hello(role, name, "inc-1", NOW)
    table.heartbeat(m.Heartbeat(role, name, "inc-1", 1, 1, free_blocks=100, total_blocks=100, draining=draining),
                    NOW)


def test_the_table_says_what_a_request_would_miss_and_changes_nothing():
    table = InstanceTable(heartbeat_timeout_s=5.0, progress_timeout_s=None, block_size=16)
    assert table.unservable(NOW) == "no live prefill/decode workers"
    join(table, TOKENIZER, "tok-0")
    join(table, PREFILL, "prefill-0")
    assert table.unservable(NOW) == "no live prefill/decode workers"  # a pair needs its decode side
    join(table, DECODE, "decode-0", draining=True)
    assert table.unservable(NOW) == "no live prefill/decode workers"  # a draining member takes no new work
    join(table, DECODE, "decode-1")
    assert table.unservable(NOW) is None
    assert table.unservable(NOW + 6.0) == "no live prefill/decode workers"  # their heartbeats are too old
    table = InstanceTable(heartbeat_timeout_s=5.0, progress_timeout_s=None, block_size=16)
    table.hello(WORKER, "worker-0", "inc-1", NOW)
    assert table.unservable(NOW) == "no live prefill/decode workers"  # welcomed, no heartbeat yet
    join(table, WORKER, "worker-0")
    assert table.unservable(NOW) == "no live tokenizer"
    join(table, TOKENIZER, "tok-0")
    join(table, TOKENIZER, "tok-1")
    assert table.unservable(NOW) is None
    assert [table.pick_tokenizer(NOW).name for _ in range(2)] == ["tok-0", "tok-1"]  # round robin untouched


def test_the_router_answers_a_clients_question_as_members_join_and_as_it_drains():
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        router = RouterService("router-ready", "inproc://ready-front", "inproc://ready-back", ctx,
                               RouterConfig(heartbeat_timeout_s=30.0))
        task = asyncio.ensure_future(router.run())
        client = AsyncClient("inproc://ready-front", ctx=ctx, timeout_s=WAIT_S)
        members: list[Any] = []

        async def member(role: str, name: str) -> None:
            sock = make_dealer(ctx, "inproc://ready-back", name.encode())
            members.append(sock)
            await asend_msg(sock, m.Hello(m.PROTOCOL_VERSION, role, name, capabilities={"incarnation": "i0"}))
            await asend_msg(sock, m.Heartbeat(role, name, "i0", 1, 1, free_blocks=100, total_blocks=100))

        async def status_once(changed_from: str | None) -> m.MeshStatus:
            """The router's answer once it differs from `changed_from` (members' messages arrive on another
            socket than the question, so the router may not have read them yet)."""
            deadline = time.monotonic() + WAIT_S
            while True:
                status = await client.mesh_status()
                if status.reason != changed_from:
                    return status
                assert time.monotonic() < deadline, f"the router still says {changed_from!r}"
                await asyncio.sleep(0.01)

        try:
            await client.connect()
            first = await client.mesh_status()
            assert first == m.MeshStatus(first.request_id, False, "no live prefill/decode workers")
            await member("worker", "w0")
            assert (await status_once(first.reason)).reason == "no live tokenizer"
            await member("tokenizer", "tok0")
            ready = await status_once("no live tokenizer")
            assert ready.servable and ready.reason == ""
            assert router.core.num_inflight == 0  # a question admits nothing
            router.core.draining = True  # what `drain()` sets first
            draining = await client.mesh_status()
            assert not draining.servable and draining.reason == "the router is shutting down"
        finally:
            await client.close()
            for sock in members:
                sock.close(linger=0)
            router.stop()
            await asyncio.wait([task], timeout=WAIT_S)
            ctx.destroy(linger=0)

    asyncio.run(run())


class AskedClient:
    """A connected client whose mesh_status waits for the test to answer; counts the questions."""

    connected = True

    def __init__(self) -> None:
        self.asked = 0
        self.answer: asyncio.Future[Any] | None = None

    async def mesh_status(self) -> m.MeshStatus:
        self.asked += 1
        self.answer = asyncio.get_running_loop().create_future()
        result = await self.answer
        if isinstance(result, BaseException):
            raise result
        return result


async def turns(n: int = 10) -> None:
    """Let the loop run the tasks that are ready (a few turns: a task starts a task that starts a task)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_concurrent_probes_share_one_question_and_no_answer_is_reused():
    async def run() -> None:
        pool = RouterPool("inproc://nobody", 1, 60.0, {})
        assert await pool.servable() == (False, "waiting for the router")  # no connection yet
        client = AskedClient()
        pool.clients.append(client)  # type: ignore[arg-type]
        probes = [asyncio.ensure_future(pool.servable()) for _ in range(5)]
        await turns()
        probes[0].cancel()  # a probe whose HTTP client left does not cancel the others' question
        await turns()
        assert client.asked == 1 and client.answer is not None
        client.answer.set_result(m.MeshStatus("q", False, "no live tokenizer"))
        assert await asyncio.gather(*probes[1:]) == [(False, "no live tokenizer")] * 4
        later = asyncio.ensure_future(pool.servable())
        await turns()
        assert client.asked == 2  # asked again: the earlier answer is not reused
        client.answer.set_result(m.MeshStatus("q", True))
        assert await later == (True, "")
        failing = asyncio.ensure_future(pool.servable())
        await turns()
        client.answer.set_result(MeshError("lost the connection to the router"))
        servable, why = await failing
        assert not servable and "lost the connection" in why

    asyncio.run(run())


class Tokenizer:
    vocab_size = 10

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1]

    def decode(self, ids: list[int]) -> str:
        return "a"


@pytest.mark.parametrize("answer, status, body", [
    ((True, ""), 200, {"status": "ready"}),
    ((False, "no live prefill/decode workers"), 503,
     {"status": "not ready", "reason": "no live prefill/decode workers"}),
    ((False, "waiting for the router"), 503, {"status": "not ready", "reason": "waiting for the router"}),
])
def test_ready_is_the_router_s_answer_and_health_is_the_process(answer, status, body):
    gw = Gateway("inproc://nobody", "tiny", Tokenizer(), 1000)

    async def servable() -> tuple[bool, str]:
        return answer

    gw.routers.servable = servable  # type: ignore[method-assign]
    http = TestClient(build_app(gw))
    r = http.get("/ready")
    assert (r.status_code, r.json()) == (status, body)
    assert status == 200 or r.headers["retry-after"] == "1"
    assert http.get("/health").json() == {"status": "ok"}
