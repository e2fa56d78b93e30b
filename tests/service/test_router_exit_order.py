"""A supervisor's exit note and the dead service's last messages reach the router on two connections, and the
router may read the note first. What the service sent before it died still counts: a request whose final text
was queued when the note was read is answered, not moved or failed; the exit is acted on after that.

The order "note first" is forced, not hoped for: the tokenizer's final text is sent only once the router has
read the note. A real router and real `Service`s over ipc:// (tests/service/test_drain.py's harness)."""

from __future__ import annotations

import asyncio
import os

from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import asend_msg
from deepinfer.services.router_state import Phase
from tests.service.test_drain import mesh_at, until


def test_a_dead_tokenizers_final_text_read_after_its_exit_note_still_finishes_the_request(tmp_path):
    async def run() -> None:
        async with mesh_at(tmp_path) as mesh:
            await mesh.member("worker-0", role="worker")
            tok = await mesh.member("tok-a")  # the only tokenizer: a request moved off it could only fail
            rid = await mesh.generate()
            await until(lambda: len(tok.encodes) == 1, "the request at the tokenizer")
            inner = tok.encodes[0].request_id
            await tok.send_router(m.EncodeResult(inner, [1, 2, 3], []))
            await until(lambda: mesh.router.core.request(inner).phase is Phase.PREFILLING, "placed on the worker")
            await mesh.members["worker-0"].send_router(m.PrefillDone(inner, "worker-0", 3, 0))
            await until(lambda: mesh.router.core.request(inner).phase is Phase.DECODING, "decoding")

            await asend_msg(mesh.operator, m.ServiceExited("tok-a", os.getpid(), -9))  # a supervisor- identity
            await until(lambda: len(mesh.router._exits) == 1, "the router read the exit note")
            final = m.TextDeltaItem(inner, 0, "hi", [7], finished=True, finish_reason="length")
            await tok.send_router(m.TextDeltas("tok-a", [final]))

            replies = [await mesh.client_reply()]
            while not isinstance(replies[-1], (m.RequestFinished, m.ErrorReply)):
                replies.append(await mesh.client_reply())
            assert not any(isinstance(r, m.ErrorReply) for r in replies), replies
            assert replies[-1].request_id == rid and replies[-1].finish_reason == "length"
            # ...and the exit was acted on, once the request no longer needed the tokenizer.
            await until(lambda: not mesh.inst("tok-a").alive, "the exit acted on")
            assert mesh.router.core.num_inflight == 0 and mesh.router.core.metrics.moves == 0

    asyncio.run(run())

