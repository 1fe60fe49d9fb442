"""The vision attention bench's step mixes: images of S x S patches, held as the tower's plan holds them."""

from __future__ import annotations

import pytest

from lab.bench.vision_attention import DEFAULT_MIXES, mix_runs, parse_mixes


def test_a_mix_lists_each_steps_image_sides_in_patches():
    assert parse_mixes("62,62,48;124,32") == [[62, 62, 48], [124, 32]]
    assert parse_mixes("") == []
    assert all(mix for mix in parse_mixes(DEFAULT_MIXES))


@pytest.mark.parametrize("text", ["62,0", "63,48", "62,-2"])
def test_a_side_the_tower_cannot_merge_is_refused_naming_the_mixes(text):
    with pytest.raises(ValueError, match="even patch counts"):
        parse_mixes(text)


def test_consecutive_images_of_one_size_are_one_run_of_frames():
    assert mix_runs([62, 62, 48, 62]) == [(3844, 2), (2304, 1), (3844, 1)]
    assert mix_runs([]) == []
