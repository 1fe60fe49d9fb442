"""workers/stats.py: the one percentile (LoadGen's index) and the one Poisson arrival generator."""

import math

from workers.stats import percentile, poisson_arrivals


def test_percentile_takes_the_element_at_floor_q_times_n_as_loadgen_does():
    values = list(range(100, 0, -1))  # unsorted on purpose
    assert percentile(values, 0.99) == 100  # index 99 of 100: the largest
    assert percentile(values, 0.5) == 51
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([7.0], 0.99) == 7.0


def test_percentile_of_no_values_is_the_given_empty_value():
    assert math.isnan(percentile([], 0.99))
    assert percentile([], 0.5, empty=0.0) == 0.0
    assert percentile([], 0.99, empty=math.inf) == math.inf


def test_poisson_arrivals_are_seeded_increasing_and_average_one_over_qps_apart():
    arrivals = poisson_arrivals(20.0, 20_000, seed=3)
    assert arrivals == poisson_arrivals(20.0, 20_000, seed=3)
    assert arrivals != poisson_arrivals(20.0, 20_000, seed=4)
    assert all(b > a for a, b in zip(arrivals, arrivals[1:])) and arrivals[0] > 0
    assert abs(arrivals[-1] / len(arrivals) - 1 / 20.0) < 0.05 / 20.0
