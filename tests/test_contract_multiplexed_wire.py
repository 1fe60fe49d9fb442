"""contract.multiplexed_wire: entries framed around serialized bytes parse as the .proto's messages, and a stand-in
worker reads the call ids a message starts from its bytes alone."""

from __future__ import annotations

from contract.multiplexed_wire import cancel_entry, chunk_entry, generate_entry, started_calls, varint
from contract.wire import pb


def test_varints_are_protobufs():
    assert varint(0) == b"\x00"
    for value in (1, 127, 128, 300, 2**32 - 1, 2**63):  # what follows call_id's tag byte
        assert varint(value) == pb.MultiplexedRequest(call_id=value).SerializeToString()[1:]


def test_entries_joined_parse_as_one_message_of_them_in_order():
    request = pb.GenerateRequest(request_id="r#1", prompt_token_ids=list(range(200)), images=[b"\xff" * 300])
    patch = pb.GenerateRequest(request_id="r#2", deadline_s=1.5)  # merged on parsing, as the router sends attempts
    payload = request.SerializeToString() + patch.SerializeToString()
    message = b"".join([generate_entry(1, payload, whole=True), cancel_entry(300), generate_entry(2**40, b"", False)])
    first, cancel, empty = pb.MultiplexedRequests.FromString(message).requests
    assert (first.call_id, first.whole, first.generate.request_id, first.generate.deadline_s) == (1, True, "r#2", 1.5)
    assert list(first.generate.prompt_token_ids) == list(range(200)) and first.generate.images == [b"\xff" * 300]
    assert (cancel.call_id, cancel.cancel, cancel.HasField("generate")) == (300, True, False)
    assert (empty.call_id, empty.whole, empty.HasField("generate")) == (2**40, False, True)
    assert started_calls(message) == [1, 2**40]


def test_a_chunk_entry_parses_as_a_reply_carrying_the_chunk():
    chunk = pb.GenerateChunk(token_ids=[5] * 200, finish_reason=pb.LENGTH)
    replies = pb.MultiplexedReplies.FromString(chunk_entry(7, chunk.SerializeToString()) * 2).replies
    assert [(r.call_id, r.chunk) for r in replies] == [(7, chunk), (7, chunk)]
