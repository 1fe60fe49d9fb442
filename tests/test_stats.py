"""contract/stats.py: the one percentile (LoadGen's index), LoadGen's early-stopping test and the one Poisson arrival generator."""

import math

import pytest

from contract.stats import (
    early_stopping_met, early_stopping_min_queries, percentile, permuted_draws, poisson_arrivals,
)


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


def test_samples_are_drawn_as_loadgen_draws_them_for_q3vl_whole_shuffled_passes_over_the_pool():
    draws = permuted_draws(500, 2_000, seed=1)
    assert len(draws) == 2_000 and draws == permuted_draws(500, 2_000, seed=1)
    passes = [draws[i:i + 500] for i in range(0, 2_000, 500)]
    assert all(sorted(p) == list(range(500)) for p in passes)  # each sample once every 500 queries
    assert passes[0] != passes[1] and passes[0] != list(range(500))  # shuffled, each pass anew
    assert sorted(permuted_draws(3, 7, seed=2)[:6]) == [0, 0, 1, 1, 2, 2]  # a partial pass at the end


@pytest.mark.parametrize("over", [0, 1, 3])
def test_early_stopping_needs_as_many_queries_as_real_loadgen_says(tmp_path, over):
    """A real LoadGen Server run of 100 queries whose first `over` answers miss its target latency: its early-stopping
    result asks for exactly early_stopping_min_queries(over) queries in all."""
    import re

    from audit.loadgen_logs import parse_detail_log
    from tests.helpers.loadgen_fixtures import SLOW_BOUND_MS, LoadGenRunSpec, run_loadgen

    spec = LoadGenRunSpec("Server", "PerformanceOnly", total_samples=50, min_duration_ms=100, min_query_count=100,
                          target_qps=500, server_target_latency_ms=SLOW_BOUND_MS, slow_queries=over)
    detail = parse_detail_log(run_loadgen(spec, tmp_path) / "mlperf_log_detail.txt")
    text = " ".join(str(detail["early_stopping_result"]).split())
    processed = int(re.search(r"Processed (\d+) queries", text).group(1))
    more = int(re.search(r"at least (\d+) more queries", text).group(1))
    assert detail["early_stopping_met"] is False
    assert processed + more == early_stopping_min_queries(over)


def test_early_stopping_accepts_a_run_only_with_enough_queries_for_those_over_the_bound():
    assert [early_stopping_min_queries(h) for h in (0, 1, 2, 8)] == [459, 662, 838, 1736]
    assert early_stopping_met([0.1] * 459, bound=1.0) and not early_stopping_met([0.1] * 458, bound=1.0)
    assert not early_stopping_met([0.1] * 500 + [2.0], bound=1.0)  # one over: 662 needed
    assert early_stopping_met([0.1] * 700 + [2.0], bound=1.0)
    assert early_stopping_met([1.0] * 459, bound=1.0)  # at the bound is not over it
    with pytest.raises(ValueError):
        early_stopping_min_queries(-1)
