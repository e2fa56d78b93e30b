"""The wire contract between services: message types, codec, framing, socket helpers.

Importing this package does not import torch (tensor fields import it when used). The submodules:
errors (ProtocolError), limits (Limits), records (@record / @message), tensors (Tensor fields),
codec (msgpack), framing (multipart frames), messages (the mesh's records), handshake (check_hello),
sockets (socket factories and send/recv).
"""

from deepinfer.protocol import messages
from deepinfer.protocol.codec import decode, encode
from deepinfer.protocol.errors import ERROR_CODES, ProtocolError
from deepinfer.protocol.framing import decode_frames, encode_frames, type_frame
from deepinfer.protocol.handshake import check_hello
from deepinfer.protocol.limits import DEFAULT_LIMITS, Limits
from deepinfer.protocol.messages import *  # noqa: F403 - the message records are the package's API
from deepinfer.protocol.records import message, record, registered_messages, type_id_of
from deepinfer.protocol.tensors import Tensor, TensorRef, frame_to_tensor, tensor_to_frame

__all__ = [
    *messages.__all__,
    "DEFAULT_LIMITS",
    "ERROR_CODES",
    "Limits",
    "ProtocolError",
    "Tensor",
    "TensorRef",
    "check_hello",
    "decode",
    "decode_frames",
    "encode",
    "encode_frames",
    "frame_to_tensor",
    "message",
    "record",
    "registered_messages",
    "tensor_to_frame",
    "type_frame",
    "type_id_of",
]
