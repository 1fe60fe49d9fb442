"""Resend-with-resume: a request whose call ends before its answer does is sent again, resuming after the tokens it
has already received, so that no token is lost or repeated. The SUT resends to the router when the router is
unreachable (harness/sut.py), the router to another worker when one fails (router/dispatch.py); both through
resend_with_resume, each with its own policy of when to send again."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from contract.wire import pb


@dataclass
class Resume:
    """One request's tokens across the calls that serve it: how many it asked for, and those it has received."""

    max_tokens: int
    received: list[int] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.received)

    def patch(self) -> pb.GenerateRequest:
        """What the next call changes of the request as first sent: resume after the tokens received, ask for the
        rest. Merged into that request (MergeFrom, or its serialized bytes appended to the request's), it appends
        them to the request's own resume_token_ids and sets sampling.max_tokens."""
        return pb.GenerateRequest(resume_token_ids=self.received, sampling=pb.SamplingParams(max_tokens=self.remaining))


Send = Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateChunk]]


async def resend_with_resume(send: Send, resume: Resume, resend: Callable[[Exception], Awaitable[bool]]
                             ) -> AsyncIterator[pb.GenerateChunk]:
    """The chunks of send(resume.patch()), their tokens recorded in resume.received as they pass, until a call ends
    without raising. When a call raises and `resend(error)` says so (having waited as its policy wants, and raising
    if it wants to end the request otherwise), the request is sent again with a new patch; else the error
    propagates. Nothing is sent once nothing remains to ask for: the stream then ends without a final chunk (every
    token arrived, the call that carried them did not end), and the caller says how the answer ended."""
    while resume.remaining > 0:
        try:
            async for chunk in send(resume.patch()):
                resume.received.extend(chunk.token_ids)
                yield chunk
            return
        except Exception as exc:  # noqa: BLE001 - the policy decides which failures are sent again
            if not await resend(exc):
                raise
