"""A run's raw logs (user.conf, LoadGen's logs, the latency plot) are written in a staging dir beside
runs/<system>/<Scenario> and moved into place only when every test of the run has completed.

An interrupted or failed run leaves the previous run's logs as they were (never a 0-byte summary beside an older
plot); what a run writes replaces, entry by entry, only what it wrote (a `--mode accuracy` run keeps the
performance logs of an earlier run). A failed run's staging dir is kept for reading until the next run starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from harness.interrupts import deferred

logger = logging.getLogger(__name__)


class StagedRunLogs:
    """Context manager: `with StagedRunLogs(final) as staging:` write into `staging`; a clean exit moves its
    entries into `final`, an exception leaves `final` untouched (an interrupt, any KeyboardInterrupt, the harness's
    Interrupted included, also deletes `staging`; any other failure keeps it, named in the log, until the next
    run's start clears it). A signal while the staging dir is made or its entries are moved is delivered once
    that is done (interrupts.deferred)."""

    def __init__(self, final: Path, discard_on: tuple[type[BaseException], ...] = (KeyboardInterrupt,)) -> None:
        self.final = final
        self._discard_on = discard_on
        self.staging: Path | None = None

    def __enter__(self) -> Path:
        with deferred() as held:
            staging = self._stage()
            if held:  # interrupted meanwhile: the staging dir just made is not left behind
                shutil.rmtree(staging, ignore_errors=True)
                self.staging = None
        return staging

    def _stage(self) -> Path:
        parent = self.final.parent
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f".{self.final.name}.partial-*"):  # left by a run that was killed or failed
            shutil.rmtree(stale, ignore_errors=True)
        for stale in parent.glob(f".{self.final.name}.old-*"):  # a commit killed between its renames
            shutil.rmtree(stale, ignore_errors=True)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.partial-", dir=parent))
        os.chmod(self.staging, 0o755)  # mkdtemp makes it 0700; the logs are shared like the tree
        return self.staging

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        staging, self.staging = self.staging, None
        if staging is None:
            return
        if exc_type is None:
            with deferred():  # never half moved: a signal meanwhile is delivered once every entry is in place
                _move_entries(staging, self.final)
        elif issubclass(exc_type, self._discard_on):
            shutil.rmtree(staging, ignore_errors=True)
        else:
            logger.warning("the failed run's logs are in %s (the next run deletes them)", staging)


def _move_entries(staging: Path, final: Path) -> None:
    """Renames each entry of `staging` over the same name in `final` (the old one is moved aside first, since a
    directory cannot be renamed over a non-empty one), then deletes what was moved aside and `staging`."""
    final.mkdir(parents=True, exist_ok=True)
    retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    for entry in sorted(staging.iterdir()):
        target = final / entry.name
        if target.exists() or target.is_symlink():
            os.rename(target, retired / entry.name)
        os.rename(entry, target)
    shutil.rmtree(retired)
    staging.rmdir()
