"""One run at a time per output directory: an exclusive, non-blocking flock on OUTPUT/.q3vl-output.lock, taken
before the run touches anything in OUTPUT and held to its end. run_submission takes it, and so does the peak
finder (scripts/find_peak.py, lab/peak/finder.py) on its --output: the two exclude each other on a shared one.

A second run into the same output is refused at once (a ConfigError: exit 2), naming the lock file and the pid
written in it; without this it cleared the first run's staging directory and the first run died. The kernel
releases a flock when its holder dies, so a lock left by a killed run blocks nothing. The file is unlinked while
still held when the run ends; a run that opened it meanwhile sees that (another inode at the path) and locks
the file now there, as the submission tree's own lock does (audit/submission_tree.py).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from harness.system_config import ConfigError

LOCK_FILE = ".q3vl-output.lock"


class OutputInUse(ConfigError):
    """Another live run holds the output directory's lock."""


class OutputLock:
    """`with OutputLock(output):` or `acquire()` / `release()`; acquire() raises OutputInUse when another process
    holds the lock, ConfigError when the directory cannot be made or written."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this process")
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise OutputInUse(
                    f"--output: {self.output} is in use by another run (pid {holder} holds {self.path}); wait for "
                    "it to end or choose another --output") from None
            if _same_file(self.path, fd):
                break
            os.close(fd)  # its holder unlinked it as we opened it: lock the file now at the path
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def _open(self) -> int:
        try:
            self.output.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)  # not inherited by the run's children
        except OSError as exc:
            raise ConfigError(f"--output: {self.output} is not a writable directory: {exc.strerror or exc}") from None

    def release(self) -> None:
        """Idempotent. Unlinks the file while still holding it, then lets go."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    """The holder's pid as it wrote it, or 'unknown' (it has the lock but has not written yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
