"""bench_engine.py --beside-tower: a vision-tower pass beside the engine's decode steps, on a plain second stream or in
a green context of some SMs (lab/bench/tower_beside_decode.py)."""

from __future__ import annotations

import pytest

from lab.bench import engine as bench_engine
from lab.bench.tower_beside_decode import PLAIN_STREAM, BesideTower, over_serial


def test_the_measurements_are_read_from_the_command_lines_lists():
    spec = BesideTower.parse("188,250", "0,96", batch=4, context=8192)
    assert spec.sides == (188, 250) and spec.sms == (PLAIN_STREAM, 96)
    assert (spec.batch, spec.context) == (4, 8192)


@pytest.mark.parametrize("sides, sms, named", [
    ("187", "0", "even patch counts"),     # the 2 x 2 merge needs an even side
    ("188", "-8", "SM counts"),
    ("188,x", "0", "comma-separated integers"),
    ("", "0", "comma-separated integers"),
])
def test_a_list_that_cannot_be_measured_is_refused_with_what_is_wrong(sides, sms, named):
    with pytest.raises(ValueError, match=named):
        BesideTower.parse(sides, sms, batch=4, context=8192)


def test_the_decoding_requests_last_through_every_mode_of_every_image():
    spec = BesideTower((188, 250), (0, 96, 112), decode_steps=32, max_overlap_steps=400)
    # the steps alone, then at most max_overlap_steps beside each of the 2 x 3 passes, and some to spare
    assert spec.tokens_needed() > 32 + 2 * 3 * 400
    assert BesideTower((188,), (0,)).tokens_needed() < spec.tokens_needed()


def test_both_at_once_is_weighed_against_the_pass_alone_then_the_steps_alone():
    # run129's 4,000 px pass in a green context of 96 SMs: 1,676 ms for the pass and 96 steps of 7.58 ms beside it,
    # where one after the other they take 1,252 + 96 x 7.58 ms
    assert over_serial(1675.6, 1252.0, 96, 7.577) == 0.847
    assert over_serial(500.0, 400.0, 10, 10.0) == 1.0  # no gain
    assert over_serial(1264.0, 1252.0, 0, 7.577) > 1.0  # the steps waited for the whole pass


@pytest.mark.parametrize("argv, named", [
    (["--workloads", "none", "--beside-tower", "8"], "needs a CUDA device"),
    (["--catalogue-only", "--beside-tower", "8", "--device", "cuda"], "--catalogue-only leaves out"),
    (["--workloads", "none", "--beside-tower", "7", "--device", "cuda"], "even patch counts"),
])
def test_it_is_refused_without_a_gpu_with_the_catalogue_alone_and_for_an_odd_side(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_engine.main(["--shape", "tiny", "--skip-baseline", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.gpu
def test_on_a_gpu_each_mode_gives_the_towers_time_beside_the_decode_steps(capsys):
    result = bench_engine.main(["--shape", "tiny", "--device", "cuda", "--skip-baseline", "--workloads", "none",
                                "--beside-tower", "16", "--beside-sms", "0,16", "--beside-batch", "2",
                                "--beside-context", "256"])
    capsys.readouterr()
    beside = result["ours"]["beside_tower"]
    assert beside["batch"] == 2 and beside["decode_alone_ms"] > 0
    row = beside["16"]
    assert row["patches"] == 256 and row["tower_alone_ms"] > 0
    plain = row["plain_stream"]
    assert plain["tower_ms"] > 0 and plain["decode_steps"] >= 0 and plain["over_serial"] > 0
    green = row["green_16_sms"]  # a figure, or why this torch cannot make one
    assert ("tower_ms" in green) != ("error" in green)
