"""A cache daemon's reply that arrives as the worker's wait for it times out still counts: the worker uses
it instead of marking the daemon down and recomputing (issue 37's race, on the cache link).

The order is forced: the reply's result is set in the same event-loop turn as the timeout fires, before the
waiting task resumes, which is exactly where asyncio turns the wait into a TimeoutError."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq.asyncio

from deepinfer.protocol import messages as m
from deepinfer.services.cache_client import CacheClient


class AnswerAsTimeRunsOut(dict):
    """The client's table of awaited replies, answering each entry on the loop's next turn."""

    def __init__(self, reply: Any) -> None:
        super().__init__()
        self.reply = reply

    def __setitem__(self, key: Any, fut: asyncio.Future[Any]) -> None:
        super().__setitem__(key, fut)
        asyncio.get_running_loop().call_soon(fut.set_result, self.reply)


def test_a_reply_set_as_the_wait_times_out_is_returned_and_the_daemon_stays_up(tmp_path) -> None:
    async def run() -> None:
        ctx = zmq.asyncio.Context()
        client = CacheClient("worker-0", f"ipc://{tmp_path}/cache.sock", ctx, engine=None, thread=None)
        reply = m.CacheLookupReply("r1", [])
        client._replies = AnswerAsTimeRunsOut(reply)
        try:
            got = await client._call(m.CacheLookup("r1", [], "ns"), m.CacheLookupReply, timeout_s=0)
        finally:
            client.sock.close(linger=0)
            ctx.destroy(linger=0)
        assert got is reply
        assert client.up and client.stats.timeouts == 0

    asyncio.run(run())
