"""The README's commands stay true: they are read from its code blocks and spans (never a copy here) and the
cheap ones are run: `--help` of every quoted Python CLI, the synthetic-catalogue command and the dataset check
on its output, and the download commands against the dataset paths the system YAMLs read."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness.system_config import SYNTHETIC_PREFIX, available_systems, load_system_config

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = ".venv/bin/python"
COMMAND_STARTS = ("python ", "python3 ", f"{VENV_PYTHON} ", "./run_submission.sh", "huggingface-cli ")


def code_texts() -> list[str]:
    """Every fenced block, indented block line and inline code span of the README, continuation lines joined."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    indented = [line[4:] for line in prose.splitlines() if line.startswith("    ") and not line.startswith("     ")]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"\n(?!\n)", " ", prose))  # a span may wrap a line
    lines = [line for block in fenced for line in block.replace("\\\n", " ").splitlines()]
    return [t.strip() for t in lines + indented + spans]


def commands() -> list[str]:
    found = [t.split("  #")[0].strip() for t in code_texts() if t.startswith(COMMAND_STARTS)]
    assert found, "no commands found in the README"
    return found


def python_commands() -> list[list[str]]:
    """The quoted `.venv/bin/python -m MOD ...` / `.venv/bin/python scripts/X.py ...` commands, as argv."""
    return [shlex.split(c)[1:] for c in commands() if c.startswith(VENV_PYTHON) and " -c " not in c]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300, **kwargs)


def test_the_readme_runs_python_only_from_the_venv():
    bare = [c for c in commands() if c.startswith(("python ", "python3 "))]
    assert bare == [], f"only {VENV_PYTHON} has the packages: {bare}"


def cli_entry(argv: list[str]) -> tuple[str, ...]:
    """('-m', 'router') or ('scripts/x.py',): what a quoted command runs, without its arguments."""
    return tuple(argv[:2]) if argv[0] == "-m" else (argv[0],)


QUOTED_CLIS = sorted({cli_entry(argv) for argv in python_commands()})


@pytest.mark.parametrize("entry", QUOTED_CLIS, ids=" ".join)
def test_every_python_cli_the_readme_quotes_answers_help(entry):
    result = run([*entry, "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
    for argv in python_commands():  # every option the README passes is one the CLI knows
        if cli_entry(argv) == entry:
            for option in (a.strip("[]").split("=")[0] for a in argv if a.strip("[]").startswith("--")):
                assert option in result.stdout, f"{' '.join(argv)}: {option} is not in {' '.join(entry)} --help"


def test_the_run_submission_usage_in_the_readme_matches_the_harness_help():
    script = (REPO / "run_submission.sh").read_text()
    assert f'exec {VENV_PYTHON} -m harness "$@"' in script  # so its --help is the harness's
    result = run(["-m", "harness", "--help"])
    assert result.returncode == 0, result.stderr
    quoted = [c for c in commands() if c.startswith("./run_submission.sh")]
    assert quoted
    for option in {o for c in quoted for o in re.findall(r"--[a-z-]+", c)}:
        assert option in result.stdout, f"README passes {option}, which run_submission.sh does not take"


def test_the_synthetic_catalogue_command_and_the_dataset_check_work_together(tmp_path):
    (make,) = [argv for argv in python_commands() if argv[0] == "scripts/make_synthetic_catalogue.py"]
    required = [a for a in make if not a.startswith("[") and not a.endswith("]")]  # [optional] parts left out
    out = tmp_path / "catalogue"
    made = run([out.as_posix() if a == "DIR" else a for a in required])
    assert made.returncode == 0, made.stderr[-2000:]
    samples = int(required[required.index("--samples") + 1])
    (check,) = [shlex.split(c) for c in commands() if c.startswith(VENV_PYTHON) and " -c " in c]
    code = check[check.index("-c") + 1]
    (readme_path,) = re.findall(r"'(/data/[^']+)'", code)
    result = run(["-c", code.replace(readme_path, out.as_posix())])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(samples)


def test_the_download_commands_fill_the_dataset_paths_every_system_reads():
    local_dirs = {c.split("--local-dir")[1].split()[0] for c in commands() if c.startswith("huggingface-cli ")}
    read = {section.path for name in available_systems() for section in load_system_config(name).datasets.values()
            if not section.path.startswith(SYNTHETIC_PREFIX)}
    assert read and read <= local_dirs, f"system YAMLs read {sorted(read - local_dirs)}, which no download fills"


def test_every_repository_file_the_readme_names_exists():
    top = "contract|harness|router|workers|audit|lab|scripts|tests|benchmarks|mlperf_configs|reference"
    named = {t for t in code_texts() if re.fullmatch(rf"(?:{top})/[\w./-]+", t)}
    prose = (REPO / "README.md").read_text(encoding="utf-8")  # a file cited in a sentence counts too
    named |= set(re.findall(rf"(?<![\w/.])(?:{top})/[\w/-]+\.(?:md|py|yaml|json|proto|sh)\b", prose))
    assert named, "no repository paths found in the README"
    missing = sorted(t for t in named if not (REPO / t).exists())
    assert missing == [], f"the README names files that are not in the repository: {missing}"


def test_the_min_durations_the_readme_gives_for_cpu_tiny_are_its_configs():
    prose = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    [(offline, latency)] = re.findall(r"configured `min_duration` \((\d+) s Offline, (\d+) s Server and Interactive\)",
                                      prose)
    config = load_system_config("cpu-tiny")
    assert int(offline) * 1000 == config.scenario("offline").min_duration_ms
    assert {int(latency) * 1000} == {config.scenario(s).min_duration_ms for s in ("server", "interactive")}


def test_the_router_figures_the_readme_quotes_are_those_bench_router_printed():
    import json

    prose = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    bullet = prose[prose.index("`scripts/bench_router.py` — "):prose.index("`scripts/bench_router_burst.py` — ")]
    [path] = re.findall(r"`(benchmarks/[\w.-]+\.json)`", bullet)
    run = json.loads((REPO / path).read_text())
    n = r"([\d,]+)"  # 1,406 or 820
    [quoted] = re.findall(rf"carried {n} / {n} req/s over gRPC streaming every step's tokens, {n} / {n} with "
                          rf"the SUT's 16-token chunks and {n} / {n} over HTTP", bullet)
    printed = [round(run[policy][point]["requests_per_s"]) for point in ("grpc", "grpc_sut_chunks", "http")
               for policy in ("round_robin", "least_loaded")]
    assert [int(q.replace(",", "")) for q in quoted] == printed
    [vllm] = re.findall(r"vllm-router ([\d,]+) \(", bullet)
    assert int(vllm.replace(",", "")) == round(run["vllm_router"]["http"]["requests_per_s"])
