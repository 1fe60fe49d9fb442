"""MultiplexedRequest and MultiplexedReply (contract/proto/q3vl.proto) framed around bytes already serialized.

The router holds each attempt's GenerateRequest as bytes (router.dispatch builds it from the caller's request,
serialized once, images and all), and a stand-in worker holds its reply as bytes. An embedded message field is on the
wire a length-delimited field, the same encoding as a `bytes` field (https://protobuf.dev/programming-guides/encoding/
, "Length-Delimited Records" and "Submessages"), so wrapping those bytes needs a tag and a length prepended, not a
parse and a new serialization of the request's images. What this writes parses as the .proto's messages.
"""

from __future__ import annotations

from contract.wire import pb

_GENERATE_TAG = b"\x12"  # MultiplexedRequest.generate: field 2, length-delimited
_CHUNK_TAG = b"\x12"  # MultiplexedReply.chunk: field 2, length-delimited
_CALL_ID_TAG = 0x08  # call_id: field 1, varint
_CANCEL_TAG = 0x18  # MultiplexedRequest.cancel: field 3, varint


def varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def generate_message(call_id: int, request: bytes, whole: bool) -> bytes:
    """A MultiplexedRequest starting `request` (a serialized GenerateRequest) as call `call_id`."""
    head = pb.MultiplexedRequest(call_id=call_id, whole=whole).SerializeToString()
    return head + _GENERATE_TAG + varint(len(request)) + request


def cancel_message(call_id: int) -> bytes:
    return pb.MultiplexedRequest(call_id=call_id, cancel=True).SerializeToString()


def chunk_reply(call_id: int, chunk: bytes) -> bytes:
    """A MultiplexedReply carrying `chunk` (a serialized GenerateChunk) for call `call_id`."""
    return pb.MultiplexedReply(call_id=call_id).SerializeToString() + _CHUNK_TAG + varint(len(chunk)) + chunk


def read_start(message: bytes) -> int | None:
    """The call id of a MultiplexedRequest as generate_message and cancel_message write it (call_id first) when it
    starts a request; None when it cancels one. For a stand-in worker that parses nothing else."""
    if message[0] != _CALL_ID_TAG:
        raise ValueError(f"a MultiplexedRequest that does not begin with its call_id: {message[:16]!r}")
    call_id, shift, i = 0, 0, 1
    while True:
        byte = message[i]
        call_id |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            break
        shift += 7
    return None if i < len(message) and message[i] == _CANCEL_TAG else call_id
