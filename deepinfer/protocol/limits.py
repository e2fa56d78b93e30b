"""Bounds on what a peer may make us allocate. One `Limits` value is shared by the socket options
(`zmq.MAXMSGSIZE`) and the decoder, so both sides of a connection refuse the same things.

One rule decides where each bound is enforced: **a limit is enforced per message, never per connection**
(DESIGN §9, isolation by request). libzmq enforces MAXMSGSIZE by dropping the connection a frame came on, and
with it every request in flight on that connection (on the client front, the HTTP gateway's one connection
carries every HTTP user's). So MAXMSGSIZE is only a memory ceiling for what nobody legitimate sends, set well
above the decoder's limits where one connection is shared by requests of several callers (`socket_max_frame`):
a message between the two is received, refused by the decoder, and answered by its own request id, and the
connection and everything else on it goes on.
"""

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
    # libzmq's own per-frame ceiling (zmq.MAXMSGSIZE), when it must differ from max_frame (None: max_frame).
    # A frame over it never reaches the application: libzmq drops the connection it came on instead.
    socket_max_frame: int | None = None

    @property
    def socket_frame_limit(self) -> int:
        """What a socket made with these limits sets as zmq.MAXMSGSIZE."""
        return self.max_frame if self.socket_max_frame is None else self.socket_max_frame


DEFAULT_LIMITS = Limits()

# The client front: anyone who can reach it may send, and a request is a type byte and a msgpack body (no
# buffer frames). A prompt past 2 MiB of text is past any context. The clients refuse an over-limit request
# before sending it (client_requests.encode_request); the router refuses one that arrives anyway by its
# request id ("request_too_large"), keeping the connection. Only a frame over CLIENT_SOCKET_CEILING, which no
# client of ours sends, is dropped by libzmq with the connection it came on, before it is buffered: a 1 GiB
# message costs the router nothing. The ceiling bounds what one message can make the router hold (16 MiB,
# read once and refused by a bounded look at its first bytes); the front's receive queue (RCVHWM messages per
# connection) drains at the router's refusal rate, far above the rate 16 MiB frames can arrive.
CLIENT_SOCKET_CEILING = 16 * MiB
CLIENT_LIMITS = Limits(max_frames=2, max_payload=2 * MiB, max_frame=2 * MiB, max_total=2 * MiB + 16,
                       max_str_len=2 * MiB, max_bin_len=64 * KiB, max_array_len=512 * KiB, max_map_len=4 * KiB,
                       socket_max_frame=CLIENT_SOCKET_CEILING)
