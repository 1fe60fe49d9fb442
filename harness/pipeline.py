"""The whole run behind run_submission.sh: validate the config, bring the system up, run each LoadGen test in
its own process, tear down, lay out the submission tree (scored and truncated), and print the audit verdict."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import time
from pathlib import Path

from harness.assets import resolve_checkpoint, resolve_dataset
from harness.cluster import Cluster
from harness.interrupts import deferred, interruptible
from harness.loadgen_run import TRACE_FILE
from harness.output_lock import OutputLock
from harness.preflight import check_engine_device, check_output_writable
from harness.progress import format_table
from harness.ray_network import RayUnreachable, probe_address
from harness.run_logs import StagedRunLogs
from harness.scenarios import LoadGenMode, Mode, Scenario, log_dir_for
from harness.system_config import (DATASET_FOR_SCENARIO, DEFAULT_SYSTEM, ConfigError, SystemConfig,
                                   load_system_config)
from harness.user_conf import write_user_conf

logger = logging.getLogger(__name__)

SUBMISSION_DIR = "submission"
RUNS_DIR = "runs"
PLOT_FILE = "latency.png"
CHILD_STOP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class RunOptions:
    system: str
    scenario: Scenario
    mode: Mode
    output: Path
    cache_dir: Path
    ray_address: str | None = None
    show_progress: bool = True
    command_line: tuple[str, ...] = ()


def say(message: str) -> None:
    """A progress message for the person at the terminal."""
    print(f"[q3vl] {message}", file=sys.stderr, flush=True)


def check_startable(config: SystemConfig, ray_address: str | None) -> None:
    """ConfigError, before anything starts, when the system cannot be brought up as configured."""
    if not config.system.system_desc_path.is_file():
        raise ConfigError(f"system.system_desc: {config.system.system_desc_path} does not exist")
    if ray_address is None and config.model.simulated_hardware is None:  # simulated workers need no GPUs
        config.workers.check_fits(config.ray.num_gpus, config.ray.num_cpus, "the embedded Ray (section ray)")
    if ray_address is not None:
        try:
            probe_address(ray_address, config.ray.connect_timeout_s)
        except RayUnreachable as exc:
            raise ConfigError(f"{exc} (ray.connect_timeout_s sets the wait)") from None


def run_submission(options: RunOptions) -> int:
    """Returns the audit's exit status (0 accepted, 1 rejected); raises ConfigError before starting anything (also
    when another run holds the output directory)."""
    config = load_system_config(options.system)
    config.scenario(options.scenario.value)  # the scenario must be configured for this system
    check_startable(config, options.ray_address)
    if options.ray_address is None and config.model.simulated_hardware is None:
        check_engine_device(config, options.scenario.value)  # a joined cluster's GPUs are on its own nodes
    # Before anything touches the output: a second run into it is refused here (OutputInUse, exit 2).
    with OutputLock(options.output.resolve()):
        check_output_writable(options.output.resolve())
        with interruptible():
            return _run(config, options)


def _run(config: SystemConfig, options: RunOptions) -> int:
    output = options.output.resolve()
    scenario = options.scenario
    config = config.for_scenario(scenario.value)
    scenario_dir = output / RUNS_DIR / config.system.name / scenario.result_dir_name
    say(f"system {config.system.name}, scenario {scenario.value}, mode {options.mode.value}; output in {output}")
    say("preparing the checkpoint and the dataset")
    checkpoint = resolve_checkpoint(config.model, options.cache_dir)
    kind = DATASET_FOR_SCENARIO[scenario.value]
    dataset_dir = resolve_dataset(config.dataset(scenario.value), kind, options.cache_dir)

    # Everything the run writes there (user.conf, the router's config and log, LoadGen's raw logs, the plot) is
    # staged and replaces the previous run's only once every test has completed.
    scenario_dir.mkdir(parents=True, exist_ok=True)
    with StagedRunLogs(scenario_dir) as staging:  # an interrupt (a KeyboardInterrupt) discards the staging dir
        write_user_conf(config, scenario, staging / "user.conf")
        say(f"starting the router and {config.workers.num_workers} workers (Ray)")
        started = time.monotonic()
        with Cluster(config, checkpoint, staging, options.ray_address) as cluster:
            say(f"workers registered, healthy and warm after {time.monotonic() - started:.0f} s")
            for test in options.mode.tests:
                say(f"running the LoadGen {scenario.result_dir_name} {test.value} test")
                run_test_process(options.system, scenario, test, cluster.router_address, staging,
                                 options.cache_dir, options.show_progress, cluster.embedded_router_address)
                if test is LoadGenMode.PERFORMANCE:
                    _plot(config, scenario, staging)
            say("stopping the workers and the router")
    plotted = f" and {PLOT_FILE}" if LoadGenMode.PERFORMANCE in options.mode.tests else ""
    say(f"LoadGen logs{plotted} in {scenario_dir}")
    return _report(config, options, scenario_dir, scenario_dir / "user.conf", dataset_dir, kind, checkpoint)


def run_test_process(system: str, scenario: Scenario, test: LoadGenMode, router: str, scenario_dir: Path,
                     cache_dir: Path, show_progress: bool, embedded_router: str | None = None) -> None:
    """One LoadGen test in its own process (mlperf.conf is read only by a process's first FromConfig), with
    scenario_dir/user.conf, against the running router (or, given embedded_router, the Cluster's address for it:
    routing in the test's own process); its logs land in log_dir_for(scenario_dir, test)."""
    command = [
        sys.executable, "-m", "harness", "run-test",
        "--system", system, "--scenario", scenario.value, "--test", test.value,
        "--router", router, "--scenario-dir", str(scenario_dir), "--cache-dir", str(cache_dir),
    ]
    if embedded_router is not None:
        command += ["--embedded-router", embedded_router]
    if not show_progress:
        command.append("--no-progress")
    child = None
    try:
        with deferred():  # a signal inside Popen would lose the child it has just started
            child = subprocess.Popen(command, start_new_session=True)  # signals reach it only through us
        rc = child.wait()
    except BaseException:
        if child is not None:
            with deferred():  # a second Ctrl-C must not leave the child running
                _stop_child(child)
            if show_progress:  # the child died mid-bar: what is said next starts on a line of its own
                print(file=sys.stderr, flush=True)
        raise
    if rc != 0:
        raise RuntimeError(f"the LoadGen {test.value} test exited with status {rc}")


def _stop_child(child: subprocess.Popen) -> None:
    child.terminate()
    try:
        child.wait(timeout=CHILD_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _plot(config: SystemConfig, scenario: Scenario, scenario_dir: Path) -> None:
    from harness.plot import plot_performance_run

    log_dir = log_dir_for(scenario_dir, LoadGenMode.PERFORMANCE)
    target = config.scenario(scenario.value).target_latency_ms
    plot_performance_run(
        log_dir / TRACE_FILE,
        scenario_dir / PLOT_FILE,
        f"{config.system.name} {scenario.result_dir_name}",
        offline=scenario is Scenario.OFFLINE,
        target_latency_s=target / 1000 if target else None,
    )


def _report(config: SystemConfig, options: RunOptions, scenario_dir: Path, user_conf: Path,
            dataset_dir: Path, kind: str, checkpoint: Path) -> int:
    from audit.accuracy import evaluate_accuracy_log
    from audit.submission_tree import IncompleteTree
    from contract.dataset import load_catalogue

    scenario = options.scenario.result_dir_name
    accuracy = None
    if LoadGenMode.ACCURACY in options.mode.tests:
        log = log_dir_for(scenario_dir, LoadGenMode.ACCURACY) / "mlperf_log_accuracy.json"
        accuracy = evaluate_accuracy_log(log, load_catalogue(dataset_dir, kind))
    print(_summary_table(scenario_dir, options.mode, accuracy, options.scenario), flush=True)

    tree = options.output.resolve() / SUBMISSION_DIR
    say(f"laying out the submission tree in {tree}")
    builder = submission_builder(config, tree)
    try:
        with builder:
            builder.add_system_description(config.system.system_desc_path)
            builder.add_source(Path(__file__).resolve().parents[1])
            builder.add_calibration(checkpoint, config.engine.get("kv_cache_dtype", "auto"))
            for test in options.mode.tests:
                log_dir = log_dir_for(scenario_dir, test)
                if test is LoadGenMode.PERFORMANCE:
                    builder.add_performance_run(scenario, log_dir)
                else:
                    builder.add_accuracy_run(scenario, log_dir, accuracy)
                builder.add_readme(scenario, options.command_line or sys.argv, test.value)
            builder.add_measurements(scenario, config.measurements.model_dump())
            builder.add_user_conf(scenario, user_conf)
    except IncompleteTree as exc:
        say(f"submission tree not written: {exc}")
        return 1
    return print_audit(config, options.scenario, tree)


def print_audit(config: SystemConfig, scenario: Scenario, tree: Path) -> int:
    """Prints the audit's lines and verdict as `python -m audit TREE` does and returns its exit status; under a
    cpu-tiny verdict, why the demo is rejected and what a real submission needs (harness.demo_verdict)."""
    from audit.checker import audit_tree
    from harness.demo_verdict import demo_verdict_lines

    say("auditing the submission tree")
    try:
        report = audit_tree(tree)
    except (FileNotFoundError, ValueError) as exc:
        say(f"the submission tree cannot be audited: {exc}")
        return 2
    print("\n".join(report.lines()), flush=True)
    if config.system.name == DEFAULT_SYSTEM:
        for line in demo_verdict_lines(report, config, scenario.value):
            say(line)
    return 0 if report.accepted else 1


def submission_builder(config: SystemConfig, tree: Path):
    """The system's submission tree builder; its final swap holds SIGINT/SIGTERM until the new tree is in place
    (an interrupt in the middle left the old tree in .submission.old-*, or no tree at all)."""
    from audit.submission_tree import SubmissionTreeBuilder

    return SubmissionTreeBuilder(tree, submitter=config.system.submitter, system_name=config.system.name,
                                 division=config.system.division, commit_guard=deferred)


def _summary_table(scenario_dir: Path, mode: Mode, accuracy, scenario: Scenario) -> str:
    import json

    from audit.loadgen_logs import parse_detail_log
    from audit.rules.rounds import FAILED_SAMPLES_FILE

    rows = []
    for test in mode.tests:
        log_dir = log_dir_for(scenario_dir, test)
        detail = parse_detail_log(log_dir / "mlperf_log_detail.txt")
        failed_path = log_dir / FAILED_SAMPLES_FILE
        failed = len(json.loads(failed_path.read_text())) if failed_path.is_file() else 0
        if test is LoadGenMode.PERFORMANCE:
            rate_key = "result_samples_per_second" if scenario is Scenario.OFFLINE else "result_completed_samples_per_sec"
            p99 = detail.get("result_99.00_percentile_latency_ns")
            rows.append([
                test.value, detail.get("result_validity", "?"), f"{detail.get(rate_key, 0):.3f}",
                f"{p99 / 1e9:.2f} s" if p99 is not None else "-", "-", failed,
            ])
        else:
            f1 = f"{accuracy.category_f1:.4f} (target {accuracy.target(scenario.value):.4f})"
            rows.append([test.value, "-", "-", "-", f1, failed])
    return format_table(["test", "result", "samples/s", "p99 latency", "category F1", "failed samples"], rows)
