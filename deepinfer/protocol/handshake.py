"""The once-per-connection Hello/Welcome check (DESIGN §3): pure, so services and tests share it."""

from __future__ import annotations

from deepinfer.protocol.messages import PROTOCOL_VERSION, Hello, Welcome

# A Welcome refused with this reason asks the peer for a Hello: the router restarted since the peer's last
# one, so it knows nothing of the peer (or of the requests the peer holds for the router that is gone).
SAY_HELLO = "say Hello first: this router does not know you (it restarted since your last Hello)"

_SHOWN = 12  # fingerprints are long digests; enough characters to tell two apart in a log line


def _short(value: str) -> str:
    return value if len(value) <= _SHOWN else value[:_SHOWN] + "…"


def check_hello(
    hello: Hello,
    expected_version: int = PROTOCOL_VERSION,
    expected_fingerprint: str | None = None,
    expected_scheme: str | None = None,
    *,
    service: str = "",
    instance: str = "",
) -> Welcome:
    """Accept `hello` or refuse it with every reason found, e.g. "protocol version 2 != 1; model
    fingerprint 3f2a9c01b7e4… != 9d0e4b1c22aa…" (peer's value first, ours second).

    The version must match exactly. A fingerprint or hash scheme is compared only when both sides hold one:
    None on our side means we do not care (a router front end), None from the peer means it holds no model
    state (a client). The reply echoes our own identity and expectations so the peer can log them.
    """
    reasons = []
    if hello.protocol_version != expected_version:
        reasons.append(f"protocol version {hello.protocol_version} != {expected_version}")
    if (
        expected_fingerprint is not None
        and hello.model_fingerprint is not None
        and hello.model_fingerprint != expected_fingerprint
    ):
        reasons.append(f"model fingerprint {_short(hello.model_fingerprint)} != {_short(expected_fingerprint)}")
    scheme = hello.block_hash_scheme
    if expected_scheme is not None and scheme is not None and scheme != expected_scheme:
        reasons.append(f"block hash scheme {scheme!r} != {expected_scheme!r}")
    return Welcome(
        protocol_version=expected_version,
        accepted=not reasons,
        reason="; ".join(reasons),
        service=service,
        instance=instance,
        model_fingerprint=expected_fingerprint,
        block_hash_scheme=expected_scheme,
    )
