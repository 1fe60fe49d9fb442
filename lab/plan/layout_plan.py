"""The planner's command line (scripts/plan_layout.py): the best layout of lab/plan/planner.py written as a
system YAML the harness accepts, its prediction in the comments; `--validate` prints the step model beside the
measured H200 runs (lab/plan/planner_validation.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from lab.plan.planner import SPLITS, Plan, PlanRequest, check_prefill_caps, search
from lab.plan.simulated_system import simulated_system
from workers.sim.step_model import PRODUCT_PATH_FIT

CLI_DESCRIPTION = """Searches layouts (TP width, aggregated vs prefill/decode split, routing policy) for a hardware profile and a
scenario with the step model (virtual clock, no sleeping) and writes the system YAML it recommends, the
predicted figures in its comments. `--validate` prints the model against the measured 1x and 2xH200 bench runs.

    python scripts/plan_layout.py --hardware vera-rubin --gpus 72 --scenario server --out plan.yaml
"""


def plan_config(best: Plan, request: PlanRequest, checkpoint: str | None = None) -> dict:
    """The system config of `best` (simulated workers; with `checkpoint`, the real model on CUDA), its target
    QPS 95% of the prediction."""
    split = SPLITS[best.layout]
    layout = "aggregated" if split is None else "disaggregated"
    config = simulated_system(f"plan-{request.hardware}-{request.scenario}", request.hardware,
                              workers=best.instances, layout=layout, policy=best.policy, tp=best.tp,
                              prefill_fraction=0 if split is None else split[0] / sum(split),
                              qps={request.scenario: round(best.qps * 0.95, 1)}, duration_ms=600000, samples=48289,
                              simulation={"model": request.model, "weights": request.weights,
                                          "kv_dtype": request.kv_dtype},
                              engine={"max_num_seqs": request.max_num_seqs,
                                      "max_num_batched_tokens": request.max_num_batched_tokens,
                                      **({"max_num_prefill_tokens": best.max_num_prefill_tokens}
                                         if best.max_num_prefill_tokens else {})})
    if checkpoint:
        config["model"]["checkpoint"] = checkpoint
        config["engine"]["device"] = "cuda"
        config.pop("simulation")
    return config


def plan_text(plans: list[Plan], request: PlanRequest, checkpoint: str | None = None) -> str:
    """The YAML of the best of `plans` behind a comment header: the request, the prediction, the ranking."""
    best = plans[0]
    r = request
    shape = (f"{len(r.prompts)} catalogue prompts in turn" if r.prompts else
             f"{r.prompt_tokens} prompt tokens ({r.image_tokens} visual)")
    fit = r.step_correction.name if r.step_correction else "none"
    header = [f"# plan_layout.py: {r.hardware} x {r.gpus} GPUs, scenario {r.scenario}, model {r.model} "
              f"({r.weights} weights, {r.kv_dtype} KV), workload {shape} + {r.output_tokens} output tokens; "
              f"step correction {fit}.",
              f"# Predicted (step model, virtual clock): {best.qps:.1f} {'samples/s' if r.scenario == 'offline' else 'QPS'}"
              f" with p99 {best.p99_s:.2f} s; target_qps set to 95% of it.",
              "# Layouts ranked (qps, tp, layout, policy, prompt tokens a step):"]
    header += [f"#   {p.qps:9.1f}  tp{p.tp}  {p.layout:10s} {p.policy:13s} {p.max_num_prefill_tokens or 'all'}"
               for p in plans[:10]]
    return "\n".join(header) + "\n" + yaml.safe_dump(plan_config(best, request, checkpoint), sort_keys=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """scripts/plan_layout.py's arguments (defaults: PlanRequest's)."""
    d = PlanRequest()
    parser = argparse.ArgumentParser(description=CLI_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default=d.hardware)
    parser.add_argument("--gpus", type=int, default=d.gpus)
    parser.add_argument("--scenario", default=d.scenario, choices=["offline", "server", "interactive"])
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--weights", default=d.weights, choices=["bf16", "fp8", "fp4"])
    parser.add_argument("--kv-dtype", default=d.kv_dtype, choices=["bf16", "fp8"])
    parser.add_argument("--policies", default=",".join(d.policies))
    parser.add_argument("--tp", default=",".join(map(str, d.tp)), help="TP widths to try")
    parser.add_argument("--layouts", default=",".join(d.layouts), help="layouts to try")
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--image-tokens", type=int, default=d.image_tokens)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--prefill-caps", default="none", metavar="N|none,...", help="engine.max_num_prefill_tokens "
                        "values to try for Server and Interactive, e.g. none,4096,2048 (none: a step's whole "
                        "--max-num-batched-tokens); Offline tries none alone")
    parser.add_argument("--requests", type=int, default=d.requests, help="simulated requests per point")
    parser.add_argument("--checkpoint", default=None, help="write a real-hardware config for this checkpoint")
    parser.add_argument("--out", default="plan.yaml")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--product-path", action="store_true", help="with --validate: the product path's LoadGen "
                        "Server points (benchmarks/planner-validation-runs.json product_path; those on FP8 with "
                        "--weights fp8 --kv-dtype fp8) beside their replay and the predicted highest valid Server QPS "
                        "(rebuilds the 1,500-sample catalogue: minutes)")
    parser.add_argument("--speedups", default=None, metavar="TEXT:VISION,...", help="with --validate "
                        "--product-path: instead of the measured points, issue 19's targets (Server at 0.85x the "
                        "replayed Offline rate, Interactive at 0.4x) with the text and vision parts' costs multiplied "
                        "by each pair, e.g. 1:1,0.5:0.5 (minutes)")
    parser.add_argument("--step-correction", default=None, metavar="FIT|none", help="the step model corrected by "
                        "this --fit-steps JSON, or 'none'; a search uses the product path's own fit by default "
                        f"({PRODUCT_PATH_FIT.name}), --validate --product-path none")
    parser.add_argument("--workload", choices=["shape", "realistic"], default="shape", help="shape: every request "
                        "is --prompt-tokens with --image-tokens visual; realistic: the realistic synthetic catalogue's "
                        "prompts in turn (the real dataset's image sizes and text lengths; made first: a minute)")
    parser.add_argument("--workload-samples", type=int, default=500, help="prompts of the realistic workload")
    parser.add_argument("--no-preparation", dest="preparation", action="store_false", help="requests join their "
                        "engine as they arrive (default: after their image's preparation on the host, at the H200 "
                        "host's measured seconds per visual token, lab/plan/planner_validation.py)")
    parser.add_argument("--request-phases", type=Path, default=None, metavar="TRACE", help="where a step trace's "
                        "finished requests spent their time: preparation, queue, first token, decode (p50/p90/p99, "
                        "and for the slowest 1%%)")
    parser.add_argument("--step-phases", type=Path, default=None, metavar="TRACE", help="where a step trace's steps "
                        "spent their wall time, by kind (decode-only, with prompt rows, tower blocks alone): seconds, "
                        "the host's share and each phase's median (the steps' phases_ms)")
    parser.add_argument("--fit-steps", type=Path, default=None, metavar="TRACE", help="fit the product path's step "
                        "model on a step trace (a steps-*.jsonl, or a directory of them: EngineConfig.step_trace_dir) "
                        "and print the correction JSON (lab/plan/step_fit.py)")
    parser.add_argument("--replay-arrivals", type=Path, default=None, metavar="TRACE", help="replay a measured run's "
                        "own arrivals (a step trace's requests, each with its catalogue sample's prompt: the realistic "
                        "catalogue of --workload-samples in --prompt-variant) on the step model with --bound-s, and "
                        "print the queries over the bound, measured and replayed (lab/plan/arrival_replay.py)")
    parser.add_argument("--bound-s", type=float, default=None, help="with --replay-arrivals: the scenario's latency "
                        "bound (Interactive 1.5, Server 12)")
    parser.add_argument("--prompt-variant", default="v6.1", choices=["v6.0", "v6.1"], help="with "
                        "--replay-arrivals: the prompts' variant (the product path's systems ask for v6.1)")
    parser.add_argument("--vision-green-sms", type=int, default=0, metavar="N", help="with --replay-arrivals: "
                        "engine.vision_green_sms on a CUDA engine (large passes beside the steps on N SMs; 0: spread)")
    args = parser.parse_args(argv)
    if (args.replay_arrivals is None) != (args.bound_s is None):
        parser.error("--replay-arrivals and --bound-s go together")
    if args.speedups is not None:
        if not (args.validate and args.product_path):
            parser.error("--speedups goes with --validate --product-path")
        try:
            args.speedups = [tuple(float(x) for x in pair.split(":", 1)) for pair in args.speedups.split(",")]
        except ValueError:
            args.speedups = []
        if not args.speedups or any(len(pair) != 2 or min(pair) <= 0 for pair in args.speedups):
            parser.error("--speedups: pairs TEXT:VISION of positive factors, comma-separated (e.g. 1:1,0.5:0.5)")
    try:
        args.prefill_caps = tuple(None if c.strip().lower() == "none" else int(c) for c in args.prefill_caps.split(","))
    except ValueError:
        parser.error(f"--prefill-caps {args.prefill_caps!r}: comma-separated token counts or 'none'")
    try:
        check_prefill_caps(args.prefill_caps, args.max_num_batched_tokens)
    except ValueError as exc:
        parser.error(f"--prefill-caps: {exc}")
    if args.step_correction is not None and args.validate and not args.product_path:
        parser.error("--step-correction goes with --validate --product-path or a search, not the bench validation")
    if args.step_correction is not None:
        args.step_correction = None if args.step_correction == "none" else Path(args.step_correction)
        if args.step_correction is not None and not args.step_correction.is_file():
            parser.error(f"--step-correction {args.step_correction}: no such file")
    elif not args.validate:
        args.step_correction = PRODUCT_PATH_FIT
    return args


def plan_request(args: argparse.Namespace) -> PlanRequest:
    """The PlanRequest of parsed arguments (comma-separated lists split; the realistic workload's prompts made)."""
    prompts: tuple = ()
    prepare = 0.0
    if args.preparation:
        from lab.plan.planner_validation import prepare_s_per_visual_token

        prepare = prepare_s_per_visual_token()
    if args.workload == "realistic":
        from lab.bench.catalogue_workload import realistic_catalogue

        prompts = tuple(r.prompt for r in realistic_catalogue(args.workload_samples))
    return PlanRequest(hardware=args.hardware, gpus=args.gpus, scenario=args.scenario, model=args.model,
                       weights=args.weights, kv_dtype=args.kv_dtype, policies=tuple(args.policies.split(",")),
                       tp=tuple(int(t) for t in args.tp.split(",")), layouts=tuple(args.layouts.split(",")),
                       prompt_tokens=args.prompt_tokens, image_tokens=args.image_tokens,
                       output_tokens=args.output_tokens, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, requests=args.requests, prompts=prompts,
                       step_correction=args.step_correction, prepare_s_per_visual_token=prepare,
                       prefill_caps=args.prefill_caps)


def _replay_arrivals(args: argparse.Namespace) -> dict:
    """--replay-arrivals: the trace's arrivals on the product path's step model (--step-correction, by default its
    own fit) with the engine limits given, each request with its sample of the realistic catalogue."""
    from lab.bench.catalogue_workload import realistic_catalogue
    from lab.plan.arrival_replay import read_arrivals, replay_arrivals
    from lab.plan.planner_validation import RUNS, product_path_model
    from workers.config import EngineConfig

    try:
        arrivals = read_arrivals(args.replay_arrivals)
        catalogue = realistic_catalogue(args.workload_samples, RUNS.product_path.catalogue_seed, args.prompt_variant)
        engine = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_prefill_tokens=args.prefill_caps[0], vision_green_sms=args.vision_green_sms,
                              device="cuda" if args.vision_green_sms else "cpu")
        model = product_path_model(args.step_correction, args.weights, args.kv_dtype)
        report = replay_arrivals(model, arrivals, catalogue, engine, args.bound_s)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"--replay-arrivals {args.replay_arrivals}: {exc}")
    fit = args.step_correction.name if args.step_correction else "none"
    return {"trace": str(args.replay_arrivals), "step_correction": fit, "weights": args.weights,
            "kv_dtype": args.kv_dtype, "engine": {"max_num_seqs": args.max_num_seqs,
                                                  "max_num_batched_tokens": args.max_num_batched_tokens,
                                                  "max_num_prefill_tokens": args.prefill_caps[0],
                                                  "vision_green_sms": args.vision_green_sms}, **report}


def main(argv: list[str] | None = None) -> None:
    """Plans (or with --validate, validates) and prints one JSON object."""
    args = parse_args(argv)
    from workers.core import step_trace

    readings = {  # a step trace's summaries: (flag, its value, the lines it reads, the summary of them)
        "--request-phases": (args.request_phases, step_trace.read_requests, step_trace.request_phases),
        "--step-phases": (args.step_phases, step_trace.read_step_lines, step_trace.step_phases),
    }
    for flag, (trace, read, summary) in readings.items():
        if trace is not None:
            try:
                print(json.dumps(summary(read(trace)), indent=1))
            except (ValueError, FileNotFoundError) as exc:
                sys.exit(f"{flag} {trace}: {exc}")
            return
    if args.fit_steps is not None:
        from lab.plan.planner_validation import product_path_model
        from workers.core.step_trace import read_steps
        from lab.plan.step_fit import fit_steps

        try:
            report = fit_steps(product_path_model(None, args.weights, args.kv_dtype), read_steps(args.fit_steps),
                               source=str(args.fit_steps))
        except (ValueError, FileNotFoundError) as exc:
            sys.exit(f"--fit-steps {args.fit_steps}: {exc}")
        print(json.dumps(report, indent=1))
        return
    if args.replay_arrivals is not None:
        print(json.dumps(_replay_arrivals(args), indent=1))
        return
    if args.validate:
        from lab.plan.planner_validation import product_path_model, product_path_rows, speedup_rows, validate

        if args.product_path:
            try:
                model = product_path_model(args.step_correction, args.weights, args.kv_dtype)
                rows = speedup_rows(model, args.speedups) if args.speedups else product_path_rows(model)
            except ValueError as exc:
                sys.exit(f"--validate --product-path: {exc}")
            print(json.dumps(rows, indent=1))
        else:
            print(json.dumps(validate(), indent=1))
        return
    request = plan_request(args)
    plans = search(request)
    if not plans:
        sys.exit(f"no layout of {args.model} fits {args.gpus} x {args.hardware}")
    Path(args.out).write_text(plan_text(plans, request, args.checkpoint))
    print(json.dumps({"out": args.out, "best": plans[0].row(), "ranked": [p.row() for p in plans]}, indent=1))
