"""Command line: `python -m harness --scenario ...` (what run_submission.sh runs) and the internal
`python -m harness run-test ...` that runs one LoadGen test in its own process."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NoReturn

from harness.scenarios import LoadGenMode, Mode, Scenario
from harness.system_config import DEFAULT_SYSTEM, ConfigError, available_systems
DEFAULT_OUTPUT = Path("submission_output")
DEFAULT_CACHE = Path.home() / ".cache" / "q3vl-harness"


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="run_submission.sh",
        description=(
            "Run the MLPerf Inference qwen3-vl-235b-a22b benchmark end to end: bring up the router and the "
            "Ray workers, run LoadGen, lay out the MLCommons submission tree under OUTPUT/submission and "
            "audit it. Exit status: 0 when the audit accepts the submission, 1 when it rejects it, "
            "2 on a usage or configuration error, 3 when the run itself failed, 130 when interrupted."
        ),
    )
    parser.add_argument("--scenario", required=True, choices=[s.value for s in Scenario],
                        help="benchmark scenario (interactive: LoadGen Server, p99 <= 1.5 s, 8k dataset)")
    parser.add_argument("--mode", default=Mode.SUBMISSION.value, choices=[m.value for m in Mode],
                        help="submission (default) = a performance run, then an accuracy run")
    parser.add_argument("--system", default=DEFAULT_SYSTEM, metavar="NAME",
                        help=f"mlperf_configs/NAME.yaml or a YAML path (default {DEFAULT_SYSTEM}; known: "
                             f"{', '.join(available_systems())})")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"LoadGen logs go to DIR/runs, the submission tree to DIR/submission (default ./{DEFAULT_OUTPUT})")
    parser.add_argument("--ray-address", metavar="ADDR", default=None,
                        help="join the Ray cluster whose head (GCS) is at host:port instead of starting an embedded "
                             "one on loopback; fails (exit 2) if nothing answers there within ray.connect_timeout_s "
                             "(default 30 s)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, metavar="DIR",
                        help=f"where the tiny checkpoint and synthetic catalogues are made on first use (default {DEFAULT_CACHE})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser


def test_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m harness run-test", description="One LoadGen test (internal).")
    parser.add_argument("--system", required=True)
    parser.add_argument("--scenario", required=True, choices=[s.value for s in Scenario])
    parser.add_argument("--test", required=True, choices=[t.value for t in LoadGenMode])
    parser.add_argument("--router", required=True, metavar="HOST:PORT")
    parser.add_argument("--embedded-router", metavar="HOST:PORT", default=None,
                        help="router.mode embedded: route in this process; its router listens here for the workers")
    parser.add_argument("--scenario-dir", required=True, type=Path)
    parser.add_argument("--cache-dir", required=True, type=Path)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_test_main(argv: list[str]) -> int:
    from harness.loadgen_run import LoadGenTestSpec, run_loadgen_test

    args = test_parser().parse_args(argv)
    _configure_logging(verbose=False)
    run_loadgen_test(LoadGenTestSpec(
        system=args.system,
        scenario=Scenario(args.scenario),
        test=LoadGenMode(args.test),
        router_address=args.router,
        embedded_router=args.embedded_router,
        scenario_dir=args.scenario_dir,
        cache_dir=args.cache_dir,
        show_progress=not args.no_progress,
    ))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run-test"]:
        return run_test_main(argv[1:])
    parser = run_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    from harness.interrupts import signal_name
    from harness.pipeline import RunOptions, run_submission

    options = RunOptions(
        system=args.system,
        scenario=Scenario(args.scenario),
        mode=Mode(args.mode),
        output=args.output,
        cache_dir=args.cache_dir,
        ray_address=args.ray_address,
        show_progress=not args.no_progress,
        command_line=("./run_submission.sh", *argv),
    )
    try:
        return run_submission(options)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except KeyboardInterrupt as exc:  # Interrupted, or Ray's KeyboardInterrupt for it
        print(f"{parser.prog}: interrupted by {signal_name(exc)}; everything started was stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # the traceback for the developer, one line for everyone else
        logging.getLogger("harness").debug("run failed", exc_info=True)
        print(f"{parser.prog}: run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
