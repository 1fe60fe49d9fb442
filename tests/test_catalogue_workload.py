"""The benchmarks' catalogue workloads: the fixed one and the synthetic catalogue with the real dataset's statistics,
whose prompts come from the product's own prompt path with the real Qwen vocabulary."""

from __future__ import annotations

from contract.prompt import system_prompt
from contract.tokenizer import IMAGE_PAD_ID, load_tokenizer
from contract.vision_geometry import image_geometry
from lab.bench.catalogue_workload import (OUTPUT_CAP, describe, fixed_catalogue, longest_request, output_lengths,
                                          realistic_catalogue)


def test_realistic_requests_are_the_exact_mlperf_prompts_of_jpeg_products():
    requests = realistic_catalogue(6, seed=3)
    tokenizer = load_tokenizer()
    assert len(requests) == 6
    for r in requests:
        (image,) = r.prompt.images
        assert image[:3] == b"\xff\xd8\xff"  # every image a JPEG, passed on as stored
        assert r.prompt.token_ids.count(IMAGE_PAD_ID) == image_geometry(image).num_tokens
        text = tokenizer.decode(r.prompt.token_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n" + system_prompt().split("\n")[0])
        assert text.endswith("<|im_start|>assistant\n")
        assert 1 <= r.output_tokens <= OUTPUT_CAP


def test_realistic_workload_depends_only_on_its_seed():
    a, b, c = realistic_catalogue(3, seed=1), realistic_catalogue(3, seed=1), realistic_catalogue(3, seed=2)
    assert a == b and a != c


def test_output_lengths_follow_the_v61_run_statistics():
    lengths = output_lengths(4000, seed=0)
    summary = describe([fixed_catalogue(1, 64, 4, n)[0] for n in lengths[:50]])
    assert 40 <= sum(lengths) / len(lengths) <= 46 and 40 <= sorted(lengths)[2000] <= 44
    assert 55 <= sorted(lengths)[int(0.99 * 4000)] <= 70 and max(lengths) <= OUTPUT_CAP
    assert summary["output_tokens"]["max"] == max(lengths[:50])


def test_fixed_workload_and_its_description():
    requests = fixed_catalogue(3, 128, 32, 7)
    assert [r.output_tokens for r in requests] == [7, 7, 7]
    summary = describe(requests)
    assert summary["visual_tokens"] == {"mean": 64, "median": 64, "p99": 64, "max": 64}
    assert summary["prompt_tokens"]["max"] == 64 + 32 + 10
    assert longest_request(requests) == 64 + 32 + 10 + 7
