"""contract.resend: a request whose call fails is sent again resuming after the tokens it received, while its policy
says so; no token is lost or repeated, and nothing is sent once nothing remains to ask for."""

from __future__ import annotations

import asyncio

import pytest

from contract.resend import Resume, resend_with_resume
from contract.wire import pb


class Dropped(Exception):
    """A call that went away mid-answer."""


def calls(*answers: tuple[list[int], bool]):
    """send() for resend_with_resume: the n-th call streams answers[n]'s tokens, one a chunk, then fails (False) or
    ends with a final chunk (True); the patches it was sent are recorded."""
    patches: list[pb.GenerateRequest] = []

    async def send(patch: pb.GenerateRequest):
        tokens, ends = answers[len(patches)]
        patches.append(patch)
        for i, token in enumerate(tokens):
            final = ends and i == len(tokens) - 1
            yield pb.GenerateChunk(token_ids=[token],
                                   finish_reason=pb.LENGTH if final else pb.FINISH_REASON_UNSPECIFIED)
        if not ends:
            raise Dropped()

    return send, patches


def collect(send, resume: Resume, resend) -> list[pb.GenerateChunk]:
    async def run():
        return [chunk async for chunk in resend_with_resume(send, resume, resend)]

    return asyncio.run(run())


async def always(_exc: Exception) -> bool:
    return True


async def never(_exc: Exception) -> bool:
    return False


def test_a_failed_call_is_sent_again_resuming_after_the_tokens_received_and_asking_for_the_rest():
    send, patches = calls(([7, 8], False), ([9], False), ([10, 11], True))
    resume = Resume(max_tokens=5)
    chunks = collect(send, resume, always)
    assert [t for c in chunks for t in c.token_ids] == resume.received == [7, 8, 9, 10, 11]
    assert [list(p.resume_token_ids) for p in patches] == [[], [7, 8], [7, 8, 9]]
    assert [p.sampling.max_tokens for p in patches] == [5, 3, 2]


def test_a_patch_merged_into_the_first_request_appends_to_its_own_resume_tokens():
    first = pb.GenerateRequest(request_id="r", resume_token_ids=[1, 2],
                               sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=9))
    resume = Resume(max_tokens=9, received=[3, 4])
    first.MergeFrom(resume.patch())
    assert list(first.resume_token_ids) == [1, 2, 3, 4]
    assert first.sampling.max_tokens == 7 and first.sampling.use_model_defaults


def test_a_failure_the_policy_does_not_resend_propagates_with_the_tokens_so_far_kept():
    send, patches = calls(([7], False), ([8], True))
    resume = Resume(max_tokens=4)
    with pytest.raises(Dropped):
        collect(send, resume, never)
    assert len(patches) == 1 and resume.received == [7]


def test_the_policy_sees_each_failure_and_may_wait_before_the_next_call():
    seen = []

    async def after_a_pause(exc: Exception) -> bool:
        seen.append(type(exc))
        await asyncio.sleep(0)
        return True

    send, patches = calls(([], False), ([5], True))
    assert [c.token_ids[0] for c in collect(send, Resume(max_tokens=3), after_a_pause)] == [5]
    assert seen == [Dropped] and len(patches) == 2


def test_once_every_token_has_arrived_nothing_more_is_sent_and_no_final_chunk_is_made_up():
    send, patches = calls(([7, 8], False), ([9], True))
    resume = Resume(max_tokens=2)
    chunks = collect(send, resume, always)
    assert len(patches) == 1 and resume.received == [7, 8]
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks)
