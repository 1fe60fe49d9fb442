"""Rules that compare one value of a LoadGen detail log with what the round requires, declared as data:
(rule id, which run's log, key, comparison, expected value for this round and scenario); beside them the two
that explain what LoadGen measured: perf-result-valid (its failing checks, audit.rules.loadgen_validity) and
perf-latency-constraint."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Literal

from audit.rules.base import Outcome, Rule, ScenarioContext, check_that, failed
from audit.rules.loadgen_validity import check_result_valid, seconds
from audit.rules.rounds import LOADGEN_SCENARIO, SCENARIOS

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, ">=": operator.ge, "<=": operator.le, ">": operator.gt}


@dataclass(frozen=True)
class LogValueRule:
    id: str
    run: Literal["performance", "accuracy"]
    key: str
    op: Literal["==", ">=", "<=", ">"]
    expected: Callable[[ScenarioContext], Any]
    description: str
    scenarios: tuple[str, ...] = SCENARIOS
    # Value to assume when LoadGen did not log the key (it omits some keys when they are false/off).
    default: Any = None
    note: Callable[[ScenarioContext], str] | None = None

    def check(self, ctx: ScenarioContext) -> Outcome:
        log = ctx.detail_log(self.run)
        expected = self.expected(ctx)
        note = f" ({self.note(ctx)})" if self.note else ""
        if self.key not in log and self.default is None:
            return failed(f"{self.key} not logged; need {self.op} {expected}{note}", log.path)
        value = log.get(self.key, self.default)
        try:
            ok = _OPS[self.op](value, expected)
        except TypeError:
            ok = False
        shown = f"{self.key} = {value}" + ("" if self.key in log else " (not logged)")
        verdict = f"{self.op} {expected}" if ok else f"need {self.op} {expected}"
        return check_that(ok, f"{shown}, {verdict}{note}", log.path)

    def as_rule(self) -> Rule:
        return Rule(self.id, "scenario", self.description, self.check, self.scenarios)


def _seed_note(ctx: ScenarioContext) -> str:
    return (f"{ctx.round.version} seeds; this log is from LoadGen "
            f"{ctx.detail_log('performance').get('loadgen_version', '?')}")


def _latency_note(ctx: ScenarioContext) -> str:
    if ctx.scenario == "Interactive":
        return ("Interactive: 1.5 s applied here; the official checker only checks LoadGen-based "
                "Interactive dirs against the Server 12 s")
    return "Server end-to-end latency"


def _sample_count_note(ctx: ScenarioContext) -> str:
    loaded = min(ctx.detail_log("performance").get("effective_performance_sample_count") or 0,
                 ctx.detail_log("performance").get("qsl_reported_total_count") or 0)
    return f"the checker's one value for every scenario; LoadGen loaded {loaded} samples"


_PERF_SERVER_LIKE = ("Server", "Interactive")

# In report order; perf-result-valid is a rule of its own (audit.rules.loadgen_validity), among them.
SPECS: tuple[LogValueRule | Rule, ...] = (
    LogValueRule("perf-scenario", "performance", "effective_scenario", "==",
                 lambda c: LOADGEN_SCENARIO[c.scenario],
                 "the performance run used the LoadGen scenario of its directory"),
    LogValueRule("perf-qsl-rng-seed", "performance", "effective_qsl_rng_seed", "==",
                 lambda c: c.round.seeds.qsl, "QSL RNG seed is the round's", note=_seed_note),
    LogValueRule("perf-sample-index-rng-seed", "performance", "effective_sample_index_rng_seed", "==",
                 lambda c: c.round.seeds.sample_index, "sample-index RNG seed is the round's", note=_seed_note),
    LogValueRule("perf-schedule-rng-seed", "performance", "effective_schedule_rng_seed", "==",
                 lambda c: c.round.seeds.schedule, "schedule RNG seed is the round's", note=_seed_note),
    LogValueRule("perf-sample-count", "performance", "effective_performance_sample_count", ">=",
                 lambda c: c.round.performance_sample_count, "performance sample count is at least the minimum",
                 note=_sample_count_note),
    LogValueRule("perf-offline-samples-per-query", "performance", "effective_samples_per_query", ">=",
                 lambda c: c.round.offline_min_samples_per_query,
                 "closed Offline query holds at least the minimum samples", scenarios=("Offline",)),
    LogValueRule("perf-min-duration", "performance", "effective_min_duration_ms", ">=",
                 lambda c: c.round.min_duration_ms, "minimum run duration is at least 600 s"),
    LogValueRule("perf-equal-issue", "performance", "effective_sample_concatenate_permutation", "==",
                 lambda c: True, "equal-issue mode (mlperf.conf sample_concatenate_permutation = 1)"),
    LogValueRule("perf-token-latencies-off", "performance", "requested_use_token_latencies", "==",
                 lambda c: False, "end-to-end latency is tracked (mlperf.conf use_token_latencies = 0)",
                 default=False),
    Rule("perf-result-valid", "scenario", "LoadGen judged the run VALID (else: its failing checks, measured and "
         "needed)", check_result_valid),
    LogValueRule("perf-result-metric", "performance", "result_samples_per_second", ">", lambda c: 0,
                 "Offline result (samples/s) is logged", scenarios=("Offline",)),
    LogValueRule("perf-result-metric", "performance", "result_completed_samples_per_sec", ">",
                 lambda c: 0, "Server/Interactive result (completed queries/s) is logged",
                 scenarios=_PERF_SERVER_LIKE),
    LogValueRule("perf-early-stopping", "performance", "early_stopping_met", "==", lambda c: True,
                 "early stopping criterion met", scenarios=_PERF_SERVER_LIKE),
    LogValueRule("accuracy-scenario", "accuracy", "effective_scenario", "==",
                 lambda c: LOADGEN_SCENARIO[c.scenario],
                 "the accuracy run used the LoadGen scenario of its directory"),
    LogValueRule("accuracy-sample-count", "accuracy", "effective_accuracy_sample_count", "==",
                 lambda c: c.round.accuracy_sample_count[c.scenario],
                 "the accuracy run covered the whole dataset"),
    LogValueRule("accuracy-total-count", "accuracy", "qsl_reported_total_count", "==",
                 lambda c: c.round.accuracy_sample_count[c.scenario],
                 "the QSL reported the whole dataset"),
)


def check_latency_constraint(ctx: ScenarioContext) -> Outcome:
    """The configured target and the latency LoadGen measured at the target percentile, both within the
    scenario's constraint; a failure shows the measured percentile, LoadGen's early-stopping verdict and
    the constraint, which is what explains a `result_validity = INVALID`."""
    log = ctx.detail_log("performance")
    constraint = ctx.round.latency_constraint_ns[ctx.scenario]
    configured = log.get("effective_target_latency_ns")
    percentile = log.get("effective_target_latency_percentile", 0.99)
    key = f"result_{percentile * 100:.2f}_percentile_latency_ns" if isinstance(percentile, float) else ""
    measured = log.get(key)
    label = f"p{percentile * 100:g}" if isinstance(percentile, float) else "percentile"
    problems = []
    if not isinstance(configured, (int, float)) or configured > constraint:
        problems.append(f"configured target {seconds(configured)} exceeds it")
    if not isinstance(measured, (int, float)):
        problems.append(f"{key or 'the percentile latency'} not logged")
    elif measured > constraint:
        over = log.get("result_overlatency_query_count")
        queries = log.get("result_query_count")
        estimate = " ".join(str(log.get("early_stopping_result", "not logged")).split())
        problems.append(f"measured {label} {seconds(measured)} exceeds it; LoadGen early stopping: "
                        f"{over} of {queries} queries over {seconds(configured)}: {estimate}")
    reason = (f"{label} constraint {seconds(constraint)} ({_latency_note(ctx)}): "
              + ("; ".join(problems) if problems else
                 f"measured {label} {seconds(measured)}, configured target {seconds(configured)}"))
    return check_that(not problems, reason, log.path)


RULES: tuple[Rule, ...] = tuple(spec.as_rule() if isinstance(spec, LogValueRule) else spec for spec in SPECS) + (
    Rule("perf-latency-constraint", "scenario", "configured target and measured percentile latency within the "
         "scenario's constraint", check_latency_constraint, _PERF_SERVER_LIKE),)
