"""Builds the MLCommons submission tree (`<division>/<submitter>/{systems,src,results}`) for one system
aside, in a hidden sibling directory, and swaps it into place only when complete; reruns merge scenarios."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from audit.accuracy import write_accuracy_txt
from audit.rules.rounds import (ACCURACY_OPTIONAL_FILES, FAILED_SAMPLES_FILE, FILED_FAILED_SAMPLES,
                                MEASUREMENTS_REQUIRED_FIELDS, MODEL, PERF_RUN_REQUIRED_FILES, SCENARIOS,
                                SCENARIO_REQUIRED_FILES)
from audit.truncate import truncate_accuracy_dir

log = logging.getLogger(__name__)

# What goes into src/: the code and configs that produced the results (generated and cached files left out).
SOURCE_ENTRIES = ("contract", "harness", "router", "workers", "audit", "lab", "mlperf_configs", "scripts",
                  "run_submission.sh", "pyproject.toml")
SOURCE_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".*", "_generated")
ACCURACY_LOG = "mlperf_log_accuracy.json"
ACCURACY_DETAIL = "mlperf_log_detail.txt"


class IncompleteTree(RuntimeError):
    """The staged tree lacks files a submission needs; nothing was put in place."""


def scenario_dir_name(scenario: str) -> str:
    """'offline' / 'Offline' -> 'Offline' (the directory name the checker expects)."""
    for name in SCENARIOS:
        if scenario.lower() == name.lower():
            return name
    raise ValueError(f"unknown scenario {scenario!r}; expected one of {', '.join(SCENARIOS)}")


class SubmissionTreeBuilder:
    """Stages `output_dir` (the dir that holds `closed/` or `open/`) and commits it atomically.

    Use as a context manager: on a clean exit the staged tree replaces `output_dir` (rename of a complete
    tree); on an exception the staging dir is deleted and `output_dir` is left as it was. An existing
    `output_dir` is copied into the staging dir first, so each run adds or replaces only what it adds.
    """

    def __init__(self, output_dir: Path, *, submitter: str, system_name: str, division: str = "closed",
                 commit_guard: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext):
        """`commit_guard()` is entered around commit's swap of the staged tree into place: the harness passes one
        that holds SIGINT/SIGTERM until the swap is over (this package installs no signal handler itself)."""
        if division not in ("closed", "open"):
            raise ValueError(f"division must be closed or open, got {division!r}")
        for label, value in (("submitter", submitter), ("system_name", system_name)):
            if not value or "/" in value or value.startswith("."):
                raise ValueError(f"{label} {value!r} is not usable as a directory name")
        self.output_dir = Path(output_dir).absolute()
        self.division = division
        self.submitter = submitter
        self.system_name = system_name
        self._staging: Path | None = None
        self._lock_path = self.output_dir.parent / f".{self.output_dir.name}.lock"
        self._commit_guard = commit_guard
        self._lock_fd: int | None = None

    # -- transaction ---------------------------------------------------------------------------------

    def __enter__(self) -> SubmissionTreeBuilder:
        self.begin()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def begin(self) -> None:
        """Takes the output's lock, clears what a killed run left, and stages a copy of the existing tree."""
        if self._staging is not None:
            raise RuntimeError("SubmissionTreeBuilder.begin() called twice")
        parent, name = self.output_dir.parent, self.output_dir.name
        parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self._lock_path)
        try:
            self._recover_interrupted_runs(parent, name)
            self._staging = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent))
            os.chmod(self._staging, 0o755)  # mkdtemp makes it 0700; the committed tree is shared/uploaded
            if self.output_dir.exists():
                shutil.copytree(self.output_dir, self._staging, symlinks=True, dirs_exist_ok=True)
        except BaseException:
            self.abort()
            raise

    def _recover_interrupted_runs(self, parent: Path, name: str) -> None:
        # Holding the lock, no other builder is active: staging dirs are from killed runs, and a retired
        # tree with no tree in place means a run died between commit's two renames.
        for stale in parent.glob(f".{name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for retired in sorted(parent.glob(f".{name}.old-*")):
            if not self.output_dir.exists() and (retired / "tree").is_dir():
                log.warning("restoring %s from an interrupted commit", self.output_dir)
                os.rename(retired / "tree", self.output_dir)
            shutil.rmtree(retired, ignore_errors=True)

    def commit(self) -> Path:
        """Checks the staged tree is complete, then swaps it into place; returns `output_dir`."""
        staging = self._require_staging()
        try:
            self._check_complete()
            with self._commit_guard():
                self._swap_in(staging)
                self._staging = None
            log.info("submission tree committed at %s", self.output_dir)
            return self.output_dir
        except BaseException:
            self.abort()
            raise
        finally:
            self._unlock()

    def _swap_in(self, staging: Path) -> None:
        """Renames `staging` to `output_dir`, the tree there first renamed aside (a directory cannot be renamed
        over a non-empty one) and deleted once the new one is in place; if the second rename fails, the old tree
        is put back. Nothing is left aside on any exit but a kill (which the next begin() clears up)."""
        if not self.output_dir.exists():
            os.rename(staging, self.output_dir)
            return
        retired = Path(tempfile.mkdtemp(prefix=f".{self.output_dir.name}.old-", dir=staging.parent))
        try:
            os.rename(self.output_dir, retired / "tree")
            try:
                os.rename(staging, self.output_dir)
            except BaseException:
                os.rename(retired / "tree", self.output_dir)
                raise
        finally:
            if self.output_dir.exists():  # never the only copy of a tree
                shutil.rmtree(retired, ignore_errors=True)

    def abort(self) -> None:
        """Deletes the staging dir; `output_dir` is untouched."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self._unlock()

    # -- contents ------------------------------------------------------------------------------------

    @property
    def submission_dir(self) -> Path:
        return self._require_staging() / self.division / self.submitter

    def scenario_dir(self, scenario: str) -> Path:
        return self.submission_dir / "results" / self.system_name / MODEL / scenario_dir_name(scenario)

    def add_system_description(self, system_json: Path) -> Path:
        """Copies mlperf_configs/systems/<name>.json as systems/<system>.json, with this tree's division and
        submitter (the JSON's values are placeholders the system YAML overrides)."""
        desc = json.loads(Path(system_json).read_text(encoding="utf-8"))
        if not isinstance(desc, dict):
            raise ValueError(f"{system_json}: system description must be a JSON object")
        desc.update(division=self.division, submitter=self.submitter)
        return _write_text(self.submission_dir / "systems" / f"{self.system_name}.json",
                           json.dumps(desc, indent=2) + "\n")

    def add_calibration(self, checkpoint: Path, kv_cache_dtype: str = "auto") -> Path:
        """Writes calibration.md in the submitter folder (the legacy checker requires it outside the open
        division): the precision of the checkpoint's weights, read from its config.json, and of the KV cache."""
        config_path = Path(checkpoint) / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else None
        return _write_text(self.submission_dir / "calibration.md",
                           calibration_text(Path(checkpoint).name, config, kv_cache_dtype))

    def add_source(self, repo_root: Path) -> Path:
        """Replaces src/ with a copy of the packages (the product's and lab/), configs and scripts under `repo_root`."""
        src = self.submission_dir / "src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        for entry in SOURCE_ENTRIES:
            path = Path(repo_root) / entry
            if path.is_dir():
                shutil.copytree(path, src / entry, ignore=SOURCE_IGNORE)
            elif path.is_file():
                shutil.copy2(path, src / entry)
            else:
                log.warning("source entry %s not found under %s; src/ goes without it", entry, repo_root)
        return src

    def add_performance_run(self, scenario: str, loadgen_dir: Path) -> Path:
        """Replaces <Scenario>/performance/run_1 with LoadGen's summary and detail logs from `loadgen_dir`."""
        run_dir = self.scenario_dir(scenario) / "performance" / "run_1"
        _replace_dir(run_dir.parent)
        run_dir.mkdir(parents=True)
        _copy_files(Path(loadgen_dir), run_dir, PERF_RUN_REQUIRED_FILES, required=True)
        self._file_failed_samples(scenario, Path(loadgen_dir), "performance")
        return run_dir

    def add_accuracy_run(self, scenario: str, loadgen_dir: Path, result: Any) -> Path:
        """Replaces <Scenario>/accuracy with LoadGen's logs, accuracy.txt for `result` (an
        `audit.accuracy.AccuracyResult`), then hashes and truncates the accuracy log."""
        acc_dir = self.scenario_dir(scenario) / "accuracy"
        _replace_dir(acc_dir)
        acc_dir.mkdir(parents=True)
        _copy_files(Path(loadgen_dir), acc_dir, (ACCURACY_DETAIL, ACCURACY_LOG), required=True)
        _copy_files(Path(loadgen_dir), acc_dir, ACCURACY_OPTIONAL_FILES, required=False)
        write_accuracy_txt(result, acc_dir / "accuracy.txt")
        truncate_accuracy_dir(acc_dir)
        self._file_failed_samples(scenario, Path(loadgen_dir), "accuracy")
        return acc_dir

    def add_measurements(self, scenario: str, fields: Mapping[str, str]) -> Path:
        """Writes <Scenario>/measurements.json from the system config's measurement fields."""
        empty = [k for k in MEASUREMENTS_REQUIRED_FIELDS if not fields.get(k)]
        if empty:
            raise ValueError(f"measurements for {scenario}: empty or missing {', '.join(empty)}")
        data = {k: fields[k] for k in MEASUREMENTS_REQUIRED_FIELDS}
        return _write_text(self.scenario_dir(scenario) / "measurements.json", json.dumps(data, indent=2) + "\n")

    def add_user_conf(self, scenario: str, user_conf: Path) -> Path:
        """Copies the user.conf LoadGen ran with."""
        text = Path(user_conf).read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"{user_conf} is empty")
        return _write_text(self.scenario_dir(scenario) / "user.conf", text)

    def add_readme(self, scenario: str, command: Sequence[str] | str, label: str) -> Path:
        """Records in <Scenario>/README.md how the `label` run (e.g. performance, accuracy) was produced;
        sections for other labels from earlier runs are kept."""
        scenario = scenario_dir_name(scenario)
        if not re.fullmatch(r"[\w-]+", label):
            raise ValueError(f"README section label must be one word, got {label!r}")
        path = self.scenario_dir(scenario) / "README.md"
        sections = _readme_sections(path.read_text(encoding="utf-8")) if path.exists() else {}
        line = command if isinstance(command, str) else shlex.join(command)
        sections[label] = f"## {label}\n\n```\n{line}\n```\n"
        header = (f"# {MODEL} {scenario} on {self.system_name}\n\n"
                  f"Produced by the q3vl harness (code in `src/`); each section gives the command line "
                  f"of one run.\n\n")
        return _write_text(path, header + "\n".join(sections[k] for k in sorted(sections)))

    # -- helpers -------------------------------------------------------------------------------------

    def _file_failed_samples(self, scenario: str, loadgen_dir: Path, run: str) -> None:
        target = self.scenario_dir(scenario) / FILED_FAILED_SAMPLES.format(run=run)
        source = loadgen_dir / FAILED_SAMPLES_FILE
        if source.is_file():
            shutil.copy2(source, target)
        else:
            target.unlink(missing_ok=True)  # a stale record from the run this one replaces

    def _check_complete(self) -> None:
        sub = self.submission_dir
        missing = []
        if not (sub / "systems" / f"{self.system_name}.json").is_file():
            missing.append(f"systems/{self.system_name}.json")
        if not (sub / "src").is_dir():
            missing.append("src/")
        results = sub / "results" / self.system_name / MODEL
        scenarios = sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []
        if not scenarios:
            missing.append(f"results/{self.system_name}/{MODEL}/<scenario>")
        for scen in scenarios:
            missing += [f"{scen.relative_to(sub)}/{f}" for f in SCENARIO_REQUIRED_FILES if not (scen / f).is_file()]
        if missing:
            raise IncompleteTree(f"submission tree for {self.system_name} is incomplete, not committed: "
                                 f"missing {', '.join(missing)}")

    def _require_staging(self) -> Path:
        if self._staging is None:
            raise RuntimeError("SubmissionTreeBuilder is not active: use it as a context manager or call begin()")
        return self._staging

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            # Unlinked while still held, so a builder that opened it meanwhile sees it gone and locks afresh (_lock).
            self._lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None


def calibration_text(checkpoint_name: str, config: Mapping[str, Any] | None, kv_cache_dtype: str) -> str:
    """calibration.md: what precision the weights and KV cache run in, and that the harness calibrates nothing.

    `config` is the checkpoint's config.json (None: simulated workers, no weights); a `quantization_config`
    there means the checkpoint ships quantized weights (e.g. the block-wise FP8 release), none means the
    released unquantized weights."""
    lines = [f"# Quantization and calibration: {checkpoint_name}", ""]
    if config is None:
        lines.append("No weights: the workers are simulated (a timing model); nothing is quantized or calibrated.")
        return "\n".join(lines) + "\n"
    quant = config.get("quantization_config")
    if not quant:
        dtype = config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get(
            "torch_dtype") or "bfloat16"
        lines.append(f"Weights: unquantized {dtype}, as in the checkpoint (its config.json has no "
                     f"quantization_config). No quantization and no calibration were done.")
    else:
        shown = ", ".join(f"{key} {quant[key]}" for key in ("quant_method", "fmt", "weight_block_size",
                                                            "activation_scheme") if key in quant)
        kept = quant.get("modules_to_not_convert") or []
        lines.append(f"Weights: quantized as the checkpoint ships them ({shown}; config.json quantization_config"
                     + (f"; {len(kept)} modules left unquantized" if kept else "") + "). The harness loads them "
                     "as they are and runs no calibration of its own.")
    if kv_cache_dtype == "fp8":
        lines.append("KV cache: fp8 (engine setting kv_cache_dtype: fp8).")
    else:
        lines.append(f"KV cache: the model's compute dtype (engine setting kv_cache_dtype: {kv_cache_dtype}).")
    return "\n".join(lines) + "\n"


def _lock(path: Path) -> int:
    """An exclusive flock on `path`, which the holder deletes when it lets go: after waiting, the lock counts
    only if `path` is still the file this process opened (not unlinked by the holder, nor made again since)."""
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _replace_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)


def _copy_files(source: Path, target: Path, names: Sequence[str], *, required: bool) -> None:
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
        elif required:
            raise FileNotFoundError(f"{source / name} missing: not a complete LoadGen output dir")


_README_SECTION = re.compile(r"^## (\S+)\n", re.MULTILINE)


def _readme_sections(text: str) -> dict[str, str]:
    starts = list(_README_SECTION.finditer(text))
    return {m.group(1): text[m.start(): starts[i + 1].start() if i + 1 < len(starts) else len(text)].rstrip() + "\n"
            for i, m in enumerate(starts)}
