"""The supervisor's word to the router that a child process exited (`ServiceExited`).

Heartbeats find a dead worker only after their timeout (seconds, during which its streams stall); the
supervisor knows the moment it reaps the child. The router then moves that worker's requests at once.
Heartbeats stay the fallback for services on other hosts, which no local supervisor watches.

Sends never block: a note the router cannot take now (it is down or restarting) is dropped, and the
heartbeat timeout covers that case as before.
"""

from __future__ import annotations

import os

import structlog
import zmq

from deepinfer.protocol import messages as m
from deepinfer.protocol.auth import ClientAuth
from deepinfer.protocol.sockets import make_dealer, send_msg

log = structlog.get_logger("deepinfer.supervisor")

SEND_TIMEOUT_MS = 200


class ExitNotifier:
    """A DEALER on the router's backend whose identity starts with "supervisor" (the router takes
    ServiceExited from no one else). On a secured backend `auth` is the supervisor's key, which may claim
    exactly such routing ids."""

    def __init__(self, backend: str, auth: ClientAuth | None = None) -> None:
        self._ctx = zmq.Context()
        self._sock = make_dealer(self._ctx, backend, f"supervisor-{os.getpid()}".encode(), auth=auth)
        self._sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)

    def __call__(self, instance: str, role: str, pid: int, returncode: int) -> None:
        if role == "router" or self._sock.closed:
            return  # the router's own exit is no news to it
        try:
            send_msg(self._sock, m.ServiceExited(instance, pid, returncode))
        except zmq.ZMQError as exc:
            log.info("exit note not sent", service=instance, error=str(exc))

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()
