"""Rules on a submission's layout and its systems: src/, calibration.md, systems/<name>.json (fields, status,
system type, network mode, division and submitter as the checker reads them), other benchmarks, scenario set."""

from __future__ import annotations

from pathlib import Path

from audit.rules.base import (Outcome, Rule, SubmissionContext, SystemContext, Unavailable, check_that, failed,
                              passed)
from audit.rules.rounds import (BENCHMARK_ALIASES, MODEL, SCENARIOS, SYSTEM_DESC_IS_NETWORK,
                                SYSTEM_DESC_MEANINGFUL_FIELDS, SYSTEM_DESC_NETWORK_FIELDS, SYSTEM_DESC_REQUIRED_FIELDS,
                                VALID_STATUS, VALID_SYSTEM_TYPES)

# Where the checker stops with a Python error instead of a verdict, the audit fails with this note.
CHECKER_STOPS = "the official checker stops with an error on it"


def check_src_dir(ctx: SubmissionContext) -> Outcome:
    src = ctx.root / "src"
    if not src.is_dir():
        return failed("src/ missing (the code that produced the results)", src)
    has_files = any(src.iterdir())
    return check_that(has_files, "present" if has_files else "empty", src)


def check_calibration_doc(ctx: SubmissionContext) -> Outcome:
    """The legacy checker (tools/submission/submission_checker_old.py, "has not calibration file") wants
    calibration.md or documentation/calibration.md in every submitter folder outside the open division."""
    paths = (ctx.root / "calibration.md", ctx.root / "documentation" / "calibration.md")
    found = next((p for p in paths if p.is_file()), None)
    if found is not None:
        return passed("present", found)
    if ctx.division == "open":
        return passed("not required in the open division", paths[0])
    return failed("missing: calibration.md or documentation/calibration.md (the quantization/calibration used)",
                  paths[0])


def check_results_present(ctx: SubmissionContext) -> Outcome:
    results = ctx.root / "results"
    systems = [s for s in ctx.systems_with_results() if SystemContext(ctx, s).results_dir.is_dir()]
    return check_that(bool(systems), f"systems with results: {', '.join(systems)}" if systems else
                      "no results/<system>/qwen3-vl-235b-a22b/ directory", results)


def check_description_readable(ctx: SystemContext) -> Outcome:
    try:
        desc = ctx.description()
    except Unavailable as e:
        return failed(e.reason.removeprefix("not checked: "), e.file)
    return passed(f"system_name {desc.get('system_name')!r}", ctx.description_path)


def check_required_fields(ctx: SystemContext) -> Outcome:
    desc = ctx.description()
    # As the checker: any truthy is_network ("false" included) asks for the network-mode fields as well.
    required = SYSTEM_DESC_REQUIRED_FIELDS + (SYSTEM_DESC_NETWORK_FIELDS if desc.get(SYSTEM_DESC_IS_NETWORK) else ())
    missing = [k for k in required if k not in desc]
    return check_that(not missing, f"missing fields: {', '.join(missing)}" if missing else
                      f"all {len(required)} required fields present", ctx.description_path)


def check_meaningful_fields(ctx: SystemContext) -> Outcome:
    desc = ctx.description()
    # Same test as the checker (`not value`): 0, "" and [] are all empty; write "0" for a count of zero.
    empty = [k for k in SYSTEM_DESC_MEANINGFUL_FIELDS if k in desc and not desc[k]]
    return check_that(not empty, f"empty fields that need a meaningful value: {', '.join(empty)}" if empty
                      else "all meaningful fields non-empty", ctx.description_path)


def check_status(ctx: SystemContext) -> Outcome:
    value = ctx.description().get("status")
    if not isinstance(value, str):
        return failed(f"status {value!r} is not a string ({CHECKER_STOPS})", ctx.description_path)
    ok = value.lower() in VALID_STATUS  # lower-cased as the checker does; spaces are not stripped
    return check_that(ok, f"status {value!r}" + ("" if ok else f" not in {', '.join(VALID_STATUS)}"),
                      ctx.description_path)


def check_system_type(ctx: SystemContext) -> Outcome:
    value = ctx.description().get("system_type")
    ok = value in VALID_SYSTEM_TYPES  # exactly as written: the checker neither strips nor lower-cases
    return check_that(ok, f"system_type {value!r}" + ("" if ok else f" not in {', '.join(VALID_SYSTEM_TYPES)}"
                                                       " (spelled exactly so)"), ctx.description_path)


def check_network_mode(ctx: SystemContext) -> Outcome:
    """is_network, as SystemCheck.network_check reads it: a string, "true" only in the network division."""
    value, division = ctx.description().get(SYSTEM_DESC_IS_NETWORK), ctx.submission.division
    if value is None:
        return passed("is_network not set: not a network-division system", ctx.description_path)
    if not isinstance(value, str):
        return failed(f"is_network {value!r} is not a string ({CHECKER_STOPS}); write \"false\" or leave it out",
                      ctx.description_path)
    network = value.lower() == "true"
    expected = {"network": True, "closed": False}.get(division)
    ok = expected is None or network == expected
    return check_that(ok, f"is_network {value!r}" + ("" if ok else f": incorrect network mode (={network}) for "
                                                      f"division '{division}'"), ctx.description_path)


def check_other_benchmarks(ctx: SystemContext) -> Outcome:
    """Results folders of other benchmarks under the system. The official checker judges each of their scenario
    dirs by that benchmark's own rules (loader.py yields every results/<system>/<benchmark>/<scenario>, and
    main.py exits 1, "submission has errors", when any of them fails), which this audit does not apply: such
    dirs fail here, with the compliance tests the checker wants of them that are missing. A folder that names no
    benchmark of the round stops the checker; one with no scenario dir it never looks into."""
    system_dir, rules = ctx.results_dir.parent, ctx.submission.round
    others = sorted(p for p in system_dir.iterdir() if p.is_dir() and p.name != MODEL)
    unknown = [p.name for p in others if p.name not in rules.benchmarks and p.name not in BENCHMARK_ALIASES]
    if unknown:
        return failed(f"not a {rules.version} benchmark: {', '.join(unknown)} ({CHECKER_STOPS})", system_dir)
    judged = [_judged_elsewhere(p, ctx) for p in others if _subdirs(p)]
    if judged:
        return failed("; ".join(judged) + ", which this audit does not apply; the official checker rejects the "
                      "whole submission when one of them fails", system_dir)
    if others:
        return Outcome("WARN", f"{', '.join(p.name for p in others)}: no scenario dir, nothing the official "
                               f"checker judges", system_dir)
    return passed(f"only {MODEL} results", system_dir)


def _subdirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _judged_elsewhere(folder: Path, ctx: SystemContext) -> str:
    """'llama3.1-8b/Offline (Missing TEST06 in compliance dir) is judged by ... llama3.1-8b's own rules': the
    compliance dirs as ComplianceCheck.dir_exists_check wants them (closed division only)."""
    benchmark, sub = BENCHMARK_ALIASES.get(folder.name, folder.name), ctx.submission
    tests = [] if sub.division == "open" else [
        t for t, models in sub.round.benchmark_compliance.items() if benchmark in models]
    dirs = []
    for scenario in _subdirs(folder):
        missing = [t for t in tests if not (folder / scenario / t).is_dir()]
        dirs.append(f"{folder.name}/{scenario}" + (f" (Missing {', '.join(missing)} in compliance dir)"
                                                   if missing else ""))
    verb = "is" if len(dirs) == 1 else "are"
    return f"{', '.join(dirs)} {verb} judged by the official checker under {benchmark}'s own rules"


def _matches_tree(ctx: SystemContext, field: str, expected: str, where: str) -> Outcome:
    """`field` of the description against the tree's directory name, both lower-cased as SystemCheck's
    submitter_check and division_check compare them (submission_checker/checks/system_check.py in
    https://github.com/mlcommons/inference/tree/master/tools/submission/submission_checker): "Closed" is closed."""
    value = ctx.description().get(field)
    if not isinstance(value, str):
        return failed(f"{field} {value!r} is not a string (the checker's .lower() raises on it and the system "
                      f"check fails)", ctx.description_path)
    ok = value.lower() == expected.lower()
    return check_that(ok, f"{field} {value!r}" + ("" if ok else f" but the tree puts it under {where}"),
                      ctx.description_path)


def check_division_matches(ctx: SystemContext) -> Outcome:
    division = ctx.submission.division
    return _matches_tree(ctx, "division", division, f"{division}/")


def check_submitter_matches(ctx: SystemContext) -> Outcome:
    sub = ctx.submission
    return _matches_tree(ctx, "submitter", sub.submitter, f"{sub.division}/{sub.submitter}/")


def check_scenario_set(ctx: SystemContext) -> Outcome:
    rules = ctx.submission.round
    present = ctx.scenario_dirs()
    unknown = [s for s in present if s not in rules.allowed_scenarios]
    missing = [s for s in rules.required_scenarios if s not in present]
    problems = []
    if unknown:
        problems.append(f"not a {rules.version} scenario of this benchmark: {', '.join(unknown)}")
    if missing:
        problems.append(f"required scenario missing: {', '.join(missing)}")
    if rules.one_of_scenarios and not any(s in present for s in rules.one_of_scenarios):
        problems.append(f"needs at least one of {', '.join(rules.one_of_scenarios)}")
    return check_that(not problems, "; ".join(problems) or f"scenarios {', '.join(present)}",
                      ctx.results_dir)


RULES: tuple[Rule, ...] = (
    Rule("src-dir", "submission", "src/ holds the code that produced the results", check_src_dir),
    Rule("calibration-doc", "submission", "calibration.md states the precision/calibration (legacy checker)",
         check_calibration_doc),
    Rule("results-present", "submission", "results exist for qwen3-vl-235b-a22b", check_results_present),
    Rule("system-description", "system", "systems/<system>.json exists and is a JSON object",
         check_description_readable),
    Rule("system-required-fields", "system", "system description has every required field",
         check_required_fields),
    Rule("system-meaningful-fields", "system", "fields that need a meaningful value are non-empty",
         check_meaningful_fields),
    Rule("system-status", "system", "status is available, preview or rdi", check_status),
    Rule("system-type", "system", "system_type is datacenter and/or edge", check_system_type),
    Rule("system-network", "system", "is_network is a string and \"true\" only in the network division",
         check_network_mode),
    Rule("system-benchmarks", "system", "no results of other benchmarks under the system (the checker judges them "
         "by their own rules, this audit does not)", check_other_benchmarks),
    Rule("system-division", "system", "division matches the tree (letter case aside)", check_division_matches),
    Rule("system-submitter", "system", "submitter matches the tree (letter case aside)", check_submitter_matches),
    Rule("scenario-set", "system", "scenario dirs are the round's: required present, none unknown",
         check_scenario_set, scenarios=SCENARIOS),
)
