"""MultiplexedRequests and MultiplexedReplies (contract/proto/q3vl.proto) framed around bytes already serialized.

The router holds each attempt's GenerateRequest as bytes (router.dispatch builds it from the caller's request,
serialized once, images and all), and a stand-in worker holds its reply as bytes. An embedded message field is on the
wire a length-delimited field, the same encoding as a `bytes` field, and a repeated field's elements are such fields
one after another (https://protobuf.dev/programming-guides/encoding/, "Length-Delimited Records", "Submessages" and
"Repeated Elements"). So a request is wrapped with a tag and a length prepended, not parsed and serialized again
with its images, and a message of several is their entries joined. What this writes parses as the .proto's messages.
"""

from __future__ import annotations

from contract.wire import pb

_ENTRY_TAG = b"\x0a"  # MultiplexedRequests.requests, MultiplexedReplies.replies: field 1, length-delimited
_GENERATE_TAG = b"\x12"  # MultiplexedRequest.generate: field 2, length-delimited
_CHUNK_TAG = b"\x12"  # MultiplexedReply.chunk: field 2, length-delimited
_CALL_ID_TAG = 0x08  # MultiplexedRequest.call_id: field 1, varint
_CANCEL_TAG = 0x18  # MultiplexedRequest.cancel: field 3, varint


def varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _entry(element: bytes) -> bytes:
    return _ENTRY_TAG + varint(len(element)) + element


def generate_entry(call_id: int, request: bytes, whole: bool) -> bytes:
    """A MultiplexedRequests entry starting `request` (a serialized GenerateRequest) as call `call_id` (> 0)."""
    head = pb.MultiplexedRequest(call_id=call_id, whole=whole).SerializeToString()
    return _entry(head + _GENERATE_TAG + varint(len(request)) + request)


def cancel_entry(call_id: int) -> bytes:
    """A MultiplexedRequests entry cancelling call `call_id`."""
    return _entry(pb.MultiplexedRequest(call_id=call_id, cancel=True).SerializeToString())


def chunk_entry(call_id: int, chunk: bytes) -> bytes:
    """A MultiplexedReplies entry carrying `chunk` (a serialized GenerateChunk) for call `call_id` (> 0)."""
    return _entry(pb.MultiplexedReply(call_id=call_id).SerializeToString() + _CHUNK_TAG + varint(len(chunk)) + chunk)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def started_calls(message: bytes) -> list[int]:
    """The call ids a MultiplexedRequests message as generate_entry and cancel_entry write it starts (its cancels
    left out), reading nothing else of it: for a stand-in worker that parses no request."""
    started, i = [], 0
    while i < len(message):
        size, start = _read_varint(message, i + 1)
        if message[i:i + 1] != _ENTRY_TAG or size == 0 or message[start] != _CALL_ID_TAG:
            raise ValueError(f"not a MultiplexedRequests entry as generate_entry writes one at byte {i}")
        call_id, after = _read_varint(message, start + 1)
        if not (after < start + size and message[after] == _CANCEL_TAG):
            started.append(call_id)
        i = start + size
    return started
