"""Rules on a submission's layout and its systems: src/, systems/<name>.json (required and meaningful
fields, status, system type, division and submitter matching the dirs) and the set of scenario dirs."""

from __future__ import annotations

from audit.rules.base import (Outcome, Rule, SubmissionContext, SystemContext, Unavailable, check_that, failed,
                              passed)
from audit.rules.rounds import (SCENARIOS, SYSTEM_DESC_MEANINGFUL_FIELDS, SYSTEM_DESC_REQUIRED_FIELDS,
                                VALID_STATUS, VALID_SYSTEM_TYPES)


def check_src_dir(ctx: SubmissionContext) -> Outcome:
    src = ctx.root / "src"
    if not src.is_dir():
        return failed("src/ missing (the code that produced the results)", src)
    has_files = any(src.iterdir())
    return check_that(has_files, "present" if has_files else "empty", src)


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
    missing = [k for k in SYSTEM_DESC_REQUIRED_FIELDS if k not in desc]
    return check_that(not missing, f"missing fields: {', '.join(missing)}" if missing else
                      f"all {len(SYSTEM_DESC_REQUIRED_FIELDS)} required fields present", ctx.description_path)


def check_meaningful_fields(ctx: SystemContext) -> Outcome:
    desc = ctx.description()
    # Same test as the checker (`not value`): 0, "" and [] are all empty; write "0" for a count of zero.
    empty = [k for k in SYSTEM_DESC_MEANINGFUL_FIELDS if k in desc and not desc[k]]
    return check_that(not empty, f"empty fields that need a meaningful value: {', '.join(empty)}" if empty
                      else "all meaningful fields non-empty", ctx.description_path)


def _field_in(ctx: SystemContext, key: str, allowed: tuple[str, ...]) -> Outcome:
    value = ctx.description().get(key)
    ok = isinstance(value, str) and value.strip().lower() in allowed
    return check_that(ok, f"{key} {value!r}" + ("" if ok else f" not in {', '.join(allowed)}"),
                      ctx.description_path)


def check_status(ctx: SystemContext) -> Outcome:
    return _field_in(ctx, "status", VALID_STATUS)


def check_system_type(ctx: SystemContext) -> Outcome:
    return _field_in(ctx, "system_type", VALID_SYSTEM_TYPES)


def check_division_matches(ctx: SystemContext) -> Outcome:
    value, expected = ctx.description().get("division"), ctx.submission.division
    return check_that(value == expected, f"division {value!r}" + ("" if value == expected else
                      f" but the tree puts it under {expected}/"), ctx.description_path)


def check_submitter_matches(ctx: SystemContext) -> Outcome:
    value, expected = ctx.description().get("submitter"), ctx.submission.submitter
    return check_that(value == expected, f"submitter {value!r}" + ("" if value == expected else
                      f" but the tree puts it under {ctx.submission.division}/{expected}/"),
                      ctx.description_path)


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
    Rule("results-present", "submission", "results exist for qwen3-vl-235b-a22b", check_results_present),
    Rule("system-description", "system", "systems/<system>.json exists and is a JSON object",
         check_description_readable),
    Rule("system-required-fields", "system", "system description has every required field",
         check_required_fields),
    Rule("system-meaningful-fields", "system", "fields that need a meaningful value are non-empty",
         check_meaningful_fields),
    Rule("system-status", "system", "status is available, preview or rdi", check_status),
    Rule("system-type", "system", "system_type is datacenter and/or edge", check_system_type),
    Rule("system-division", "system", "division matches the tree", check_division_matches),
    Rule("system-submitter", "system", "submitter matches the tree", check_submitter_matches),
    Rule("scenario-set", "system", "scenario dirs are the round's: required present, none unknown",
         check_scenario_set, scenarios=SCENARIOS),
)
