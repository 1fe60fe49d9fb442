"""Finds a system's peak through the product path (lab/peak/finder.py): Offline samples/s, then the highest target
QPS LoadGen calls VALID for Server and Interactive. Writes one JSON report and prints it as the last stdout line.
scripts/find_peak.py's command line.

Example: python scripts/find_peak.py --system h200x1-synthetic --min-duration-ms 30000 --time-budget-s 480
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from harness.cli import DEFAULT_CACHE, DEFAULT_SYSTEM, OneLineParser
from harness.interrupts import signal_name
from harness.system_config import ConfigError
from lab.peak.finder import PeakFinder, PeakSearch, default_report_path, engine_setting

DEFAULT_OUTPUT = Path("peak_output")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="find_peak.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default=DEFAULT_SYSTEM, help="mlperf_configs/NAME.yaml or a YAML path")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="the report (default benchmarks/<date>-peak-<system>.json)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="DIR",
                        help=f"every point's LoadGen logs, under DIR/runs (default ./{DEFAULT_OUTPUT})")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, metavar="DIR",
                        help="where generated checkpoints and synthetic catalogues are made on first use")
    parser.add_argument("--ray-address", default=None, metavar="ADDR", help="join this Ray cluster")
    parser.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--step-trace-dir", type=Path, default=None, metavar="DIR", help="every engine writes its "
                        "step trace (steps and requests, engine.step_trace_dir) into DIR: scripts/plan_layout.py "
                        "--fit-steps DIR and --request-phases DIR read it")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", type=engine_setting,
                        help="an engine setting over the system's engine section (repeatable; VALUE read as YAML, "
                             "e.g. --engine mixed_step_graphs=false); a scenario's own engine settings still win")
    parser.add_argument("--progress", action="store_true", help="a progress bar per point")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # The search's settings: PeakSearch's fields, its defaults where not given.
    fields = PeakSearch.model_fields
    parser.add_argument("--scenarios", type=lambda text: tuple(text.split(",")),
                        help=f"{fields['scenarios'].description}, comma-separated (default "
                             f"{','.join(fields['scenarios'].default)})")
    for name, kind in (("min_duration_ms", int), ("min_query_count", int), ("offline_query_count", int),
                       ("performance_sample_count", int),
                       ("steps", int), ("server_start_fraction", float), ("interactive_start_fraction", float),
                       ("resolution_qps", float), ("offline_samples_per_s", float), ("time_budget_s", float)):
        default = fields[name].default
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                            help=f"{fields[name].description} (default {default})")
    parser.add_argument("--no-tail-anatomy", dest="tail_anatomy", action="store_false", default=None,
                        help="skip the tail anatomy after the search (the slowest 1%% of each latency point)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    given = {name: getattr(args, name) for name in PeakSearch.model_fields if getattr(args, name, None) is not None}
    report_path = args.json or default_report_path(args.system)
    try:
        search = PeakSearch(**given)
        finder = PeakFinder(args.system, search, args.output, args.cache_dir, report_path, args.ray_address,
                            show_progress=args.progress, commit=args.commit, step_trace_dir=args.step_trace_dir,
                            engine_overrides=dict(args.engine))
        report = finder.run()
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        parser.error(f"--{str(error['loc'][0]).replace('_', '-')}: {message}" if error["loc"] else message)
    except ConfigError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt as exc:  # Interrupted, or Ray's KeyboardInterrupt for it
        print(f"find_peak.py: interrupted by {signal_name(exc)}; everything started was stopped; the points so far are in "
              f"{report_path}", file=sys.stderr)
        return 130
    except Exception as exc:  # the traceback for the developer (-v), one line for everyone else
        logging.getLogger("harness").info("search failed", exc_info=True)
        print(f"find_peak.py: search failed: {type(exc).__name__}: {exc}; the points so far are in {report_path}",
              file=sys.stderr)
        return 3
    print(json.dumps(report), flush=True)
    return 0
