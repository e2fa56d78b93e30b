"""Bounds on what a peer may make us allocate. One `Limits` value is shared by the socket options
(`zmq.MAXMSGSIZE`) and the decoder, so both sides of a connection refuse the same things."""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True)
class Limits:
    """Every field is an inclusive maximum.

    The msgpack body only carries small typed fields (token ids, hashes, text); bulk data (KV blocks) travels
    in buffer frames. So the payload bound is small, while a single buffer frame may be large.
    Worst-case memory from one payload is bounded too: msgpack turns each payload byte into at most one
    Python object (~60 bytes for an empty list), so 8 MiB costs at most ~0.5 GB transiently.
    """

    max_frames: int = 2 + 256  # type byte + payload + buffer frames (e.g. K and V per layer of a big model)
    max_payload: int = 8 * MiB  # the msgpack body
    max_frame: int = 1 * GiB  # any single frame; also zmq.MAXMSGSIZE (which libzmq applies per frame)
    max_total: int = 4 * GiB  # all frames of one message together
    max_str_len: int = 8 * MiB  # one msgpack str (a prompt)
    max_bin_len: int = 1 * MiB  # one msgpack bin (hashes, small blobs; bulk goes out of band)
    max_array_len: int = 4 * MiB  # one msgpack array (token ids of a very long context)
    max_map_len: int = 64 * KiB  # one msgpack map (records, capability dicts)


DEFAULT_LIMITS = Limits()

# The client front: anyone who can reach it may send, and a request is a type byte and a msgpack body (no
# buffer frames). A prompt past 2 MiB of text is past any context; libzmq drops a bigger frame (MAXMSGSIZE)
# before it is buffered, so a 1 GiB message costs the router nothing.
CLIENT_LIMITS = Limits(max_frames=2, max_payload=2 * MiB, max_frame=2 * MiB, max_total=2 * MiB + 16,
                       max_str_len=2 * MiB, max_bin_len=64 * KiB, max_array_len=512 * KiB, max_map_len=4 * KiB)
