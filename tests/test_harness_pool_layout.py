"""A pool's tp/ep layout reaches the engine each of its workers builds."""

from pathlib import Path

from harness.cluster import parallel_engine_factory
from harness.system_config import engine_config, load_system_config


def test_each_pool_builds_engines_with_its_own_tensor_and_expert_parallel_layout():
    config = load_system_config("h200x8")  # two TP4 instances with experts split over the ranks
    engine = engine_config(config, Path("/nonexistent/checkpoint"))
    (pool,) = config.workers.pools
    built = parallel_engine_factory(engine, pool).args[0]
    assert (built.tensor_parallel_size, built.expert_parallel) == (4, True)
    assert built.max_num_batched_tokens == engine.max_num_batched_tokens  # everything else unchanged


def test_single_gpu_pools_build_unsplit_engines():
    config = load_system_config("cpu-tiny")
    engine = engine_config(config, Path("/nonexistent/checkpoint"))
    built = parallel_engine_factory(engine, config.workers.pools[0]).args[0]
    assert (built.tensor_parallel_size, built.expert_parallel) == (1, False)
