"""Worker selection policies as pure functions: Dynamo's worked example, power of two choices, round robin."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.config import PolicyConfig
from router.policies import RouteRequest, Selector, WorkerSnapshot, kv_aware, kv_aware_cost, least_loaded, round_robin

BS = 16


def three_workers():
    """A prompt of 8 blocks; decode loads 10, 5 and 9 blocks (Dynamo's worked example without its cache credit)."""
    workers = [WorkerSnapshot("A", active_decode_blocks=10), WorkerSnapshot("B", active_decode_blocks=5),
               WorkerSnapshot("C", active_decode_blocks=9)]
    return RouteRequest(prompt_tokens=8 * BS), workers


def test_kv_aware_costs_are_prefill_blocks_plus_active_decode_blocks():
    request, workers = three_workers()
    config = PolicyConfig(name="kv_aware", block_size=BS)
    assert [kv_aware_cost(request, w, config) for w in workers] == [18, 13, 17]
    assert kv_aware(request, workers, config, random.Random(0)).worker_id == "B"


def test_the_prefix_overlap_credit_is_gone_from_the_config():
    with pytest.raises(ValueError, match="overlap_credit"):
        PolicyConfig(name="kv_aware", overlap_credit=1.0)


def test_prefill_load_scale_weights_queued_prefill_against_decode():
    config = PolicyConfig(name="kv_aware", prefill_load_scale=2.0, block_size=BS)
    busy_prefill = WorkerSnapshot("P", active_prefill_tokens=4 * BS, active_decode_blocks=0)
    busy_decode = WorkerSnapshot("D", active_prefill_tokens=0, active_decode_blocks=6)
    request = RouteRequest(prompt_tokens=BS)
    assert kv_aware_cost(request, busy_prefill, config) == 10 and kv_aware_cost(request, busy_decode, config) == 8
    assert kv_aware(request, [busy_prefill, busy_decode], config, random.Random(0)).worker_id == "D"


def test_temperature_samples_cheaper_workers_more_often():
    request, workers = three_workers()
    config = PolicyConfig(name="kv_aware", block_size=BS, temperature=0.5)
    rng = random.Random(1)
    picks = Counter(kv_aware(request, workers, config, rng).worker_id for _ in range(3000))
    assert picks["B"] > picks["C"] > picks["A"] > 0


def test_least_loaded_picks_the_lighter_of_two_sampled_workers():
    config = PolicyConfig(name="least_loaded", block_size=BS)
    light, heavy = WorkerSnapshot("light", active_decode_blocks=1), WorkerSnapshot("heavy", active_decode_blocks=50)
    request = RouteRequest(prompt_tokens=100)
    assert all(least_loaded(request, [heavy, light], config, random.Random(s)).worker_id == "light" for s in range(20))


def test_least_loaded_never_picks_the_heaviest_of_many():
    config = PolicyConfig(name="least_loaded", block_size=BS)
    workers = [WorkerSnapshot(f"w{i}", active_decode_blocks=i) for i in range(5)]
    rng = random.Random(3)
    picks = Counter(least_loaded(RouteRequest(10), workers, config, rng).worker_id for _ in range(2000))
    assert "w4" not in picks and picks["w0"] > picks["w3"]


def test_round_robin_cycles_through_workers():
    workers = [WorkerSnapshot("a"), WorkerSnapshot("b"), WorkerSnapshot("c")]
    assert [round_robin(workers, t).worker_id for t in range(5)] == ["a", "b", "c", "a", "b"]
    selector = Selector(PolicyConfig(name="round_robin"))
    assert [selector.choose(RouteRequest(1), workers).worker_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_selector_refuses_an_empty_pool():
    with pytest.raises(ValueError, match="no eligible worker"):
        Selector(PolicyConfig()).choose(RouteRequest(1), [])
