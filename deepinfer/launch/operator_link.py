"""The operator's line to a running mesh: `OperatorLink`, a DEALER on the router's backend under a supervisor
identity (the only one the router takes drains and questions from; on a secured backend only the supervisor's
key may claim it), and `mesh_topology`, the --topology / --run-dir choice the operator commands share. Used by
`drain` and `status`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

ANSWER_S = 5.0  # how long one question waits for the router's answer before it is asked again


def mesh_topology(topology: Path | None, run_dir: Path | None) -> Any:
    """The Topology of the mesh an operator command names: a topology file, or the run directory of an `up`."""
    from deepinfer.launch.topology import Topology

    if (topology is None) == (run_dir is None):
        raise click.UsageError("give the mesh's --topology FILE or the --run-dir of its `up`")
    path = topology or run_dir / "topology.toml"  # type: ignore[operator]
    if not path.is_file():
        raise click.UsageError(f"{path}: no topology there (an `up` writes topology.toml into its run directory)")
    return Topology.load(path)


class OperatorLink:
    """A DEALER on the router's backend under a supervisor identity (the only ones the router takes drains
    from), with the supervisor's key on a secured backend."""

    def __init__(self, topology: Any) -> None:
        import zmq

        from deepinfer.launch.keys import supervisor_auth
        from deepinfer.protocol.sockets import make_dealer

        self.backend = topology.backend
        self._ctx = zmq.Context()
        self._sock = make_dealer(self._ctx, topology.backend, f"supervisor-operator-{os.getpid()}",
                                 auth=supervisor_auth(topology))

    def ask(self, msg: Any, deadline: float | None = None) -> Any:
        """Send `msg`; the router's ServiceStatus about its instance. A question (ServiceQuery) not answered in
        ANSWER_S is asked again, as the router may be restarting, until `deadline` (monotonic; default ANSWER_S
        from now). A drain is sent once: sent again late, it could reach the service's successor."""
        from deepinfer.protocol import messages as m
        from deepinfer.protocol.sockets import recv_msg, send_msg

        deadline = deadline or time.monotonic() + ANSWER_S
        while True:
            send_msg(self._sock, msg)
            wait_s = min(ANSWER_S, max(0.1, deadline - time.monotonic()))
            while self._sock.poll(int(wait_s * 1000)):
                reply = recv_msg(self._sock)
                if isinstance(reply, m.ServiceStatus) and reply.instance == msg.instance:
                    return reply
            if not isinstance(msg, m.ServiceQuery) or time.monotonic() > deadline:
                raise click.ClickException(f"no answer from the router at {self.backend}")

    def __enter__(self) -> OperatorLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
