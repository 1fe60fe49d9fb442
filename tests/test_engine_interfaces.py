"""Every engine, executor and request-input maker implements its declared interface (workers/engine_api.py) method
by method: the same names, the same parameters (names, kinds, defaults) and the same coroutine-ness, so that
AsyncEngine can drive any engine core, WorkerServer can serve any serving engine and LLMEngine can run on any
executor. The simulated engine is an LLMEngine on a SimulatedExecutor, with the real engine's scheduler and request
lifecycle."""

from __future__ import annotations

import inspect

import pytest

from workers.serve.async_engine import AsyncEngine
from workers.engine import LLMEngine, WallTimer
from workers.engine_api import (
    EngineCore, Executor, LaunchedStep, RequestInputs, ServingEngine, StepLauncher, StepTimer, TowerBeside,
)
from workers.executor.model_runner import LaunchedTokens, ModelRunner
from workers.inputs.request_inputs import ModelInputs
from workers.sim.engine import SimulatedExecutor, SimulatedInputs, SimulatedStep, SimulatedTimer, simulated
from workers.sim.instant_engine import InstantEngine


def members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(("implementation", "protocol"), [
    (LLMEngine, EngineCore), (AsyncEngine, ServingEngine), (InstantEngine, ServingEngine),
    (ModelRunner, Executor), (SimulatedExecutor, Executor), (ModelInputs, RequestInputs), (SimulatedInputs, RequestInputs),
    (ModelRunner, StepLauncher), (LaunchedTokens, LaunchedStep), (SimulatedExecutor, StepLauncher),
    (SimulatedStep, LaunchedStep), (WallTimer, StepTimer), (SimulatedTimer, StepTimer),
    (ModelRunner, TowerBeside), (SimulatedExecutor, TowerBeside),
])
def test_each_engine_has_every_method_of_its_interface_with_the_same_signature(implementation, protocol):
    for name, declared in members(protocol).items():
        assert hasattr(implementation, name) or name in implementation.__init__.__code__.co_names, \
            f"{implementation.__name__} lacks {name}"
        implemented = inspect.getattr_static(implementation, name, None)
        if isinstance(declared, property):
            continue  # a property, or an attribute set in __init__: both read the same
        assert implemented is not None and callable(implemented), f"{implementation.__name__}.{name} is not a method"
        assert parameters(implemented) == parameters(declared), f"{implementation.__name__}.{name}"
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), name
        assert inspect.isasyncgenfunction(implemented) == inspect.isasyncgenfunction(declared) or (
            name == "generate" and inspect.isasyncgenfunction(implemented)), name


def test_a_built_engine_is_an_instance_of_its_interface(tiny_moe_checkpoint):
    from pathlib import Path

    from workers.config import EngineConfig
    from workers.sim.config import SimulationConfig
    from workers.sim.step_model import StepModel

    core = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=16, max_model_len=256))
    sim = simulated(EngineConfig(checkpoint=Path("simulated")), SimulationConfig(model="qwen3-vl-30b-a3b"),
                    StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=False)
    assert isinstance(core, EngineCore) and isinstance(sim, EngineCore)
    assert isinstance(core.executor, Executor) and isinstance(sim.executor, Executor)
    assert isinstance(core.executor, StepLauncher) and isinstance(sim.executor, StepLauncher)
    assert isinstance(core.executor, TowerBeside) and isinstance(sim.executor, TowerBeside)
    assert isinstance(core.inputs, RequestInputs) and isinstance(sim.inputs, RequestInputs)
    assert isinstance(core.timer, StepTimer) and isinstance(sim.timer, StepTimer)
    # one engine: the simulated one is an LLMEngine (its step loop, scheduler and request lifecycle, one constructor)
    # on another executor and clock
    assert type(sim) is type(core) is LLMEngine and type(sim.scheduler) is type(core.scheduler)
    assert isinstance(sim.executor, SimulatedExecutor) and isinstance(sim.timer, SimulatedTimer)
    served = AsyncEngine(sim)
    try:
        assert isinstance(served, ServingEngine) and isinstance(InstantEngine(), ServingEngine)
    finally:
        served.shutdown()


def test_a_launched_step_that_samples_nothing_returns_once_the_work_it_queued_has_run():
    class Work:
        waited = 0

        def wait(self):
            self.waited += 1

    work = Work()
    assert LaunchedTokens([], None, None, work).wait() == {}
    assert work.waited == 1
    assert LaunchedTokens([], None, None).wait() == {}  # nothing queued (a CPU engine's work has run)
