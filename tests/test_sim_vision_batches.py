"""lab/plan/vision_batches.py: the engine's scheduler on the fixed catalogue with no model, counting how the
images reach the vision tower."""

from __future__ import annotations

from lab.plan import vision_batches as sim


def test_every_image_is_encoded_once_and_ahead_encoding_moves_them_out_of_the_steps(capsys):
    # 12 prompts, 2 a step (budget 2 x 1,734 + decodes), every sequence fits: no preemption, each image once
    ahead, in_step = (sim.simulate(12, 16, 4096, 2 * sim.PROMPT + 16, encode_ahead=e) for e in (True, False))
    for r in (ahead, in_step):
        assert r["preemptions"] == 0 and r["images"] == 12
        assert sum(int(k) * v for k, v in r["images_per_call"].items()) == 12
    assert in_step["calls_by_kind"] == {"in_step": in_step["tower_calls"]} and in_step["images_in_step"] == 12
    assert ahead["images_in_step"] < 12 and ahead["calls_by_kind"]["ahead"] >= 1
    assert ahead["steps"] == in_step["steps"]  # where images are encoded does not change the schedule
    assert len(sim.main(["--samples", "4", "--max-num-seqs", "2,4", "--kv-blocks", "2048"])) == 2
    assert capsys.readouterr().out.count("\n") == 2
