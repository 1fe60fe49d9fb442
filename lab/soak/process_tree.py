"""The process tree below a pid, read from /proc (Linux; no extra dependency): what the fault soak and the
tests use to find the router, Ray workers and LoadGen processes a harness run started, and to check that none
of them outlives it."""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `root`."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        children[int(fields[1])].append(int(entry))
        commands[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = commands.get(pid, "")
        todo.extend(children.get(pid, []))
    return found


def alive(pid: int, command: str) -> bool:
    """`pid` still runs `command` (not a zombie, not a recycled pid)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z" and cmdline == command


class ProcessWatch:
    """Every descendant of `root` seen while it runs (read from /proc by a thread every `interval_s`), so that
    processes started after a signal count too; `wait_for(program)` returns once a descendant runs `program`."""

    def __init__(self, root: int, interval_s: float = 0.05) -> None:
        self.root = root
        self.seen: dict[int, str] = {}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(interval_s,), daemon=True)
        self._thread.start()

    def _watch(self, interval_s: float) -> None:
        try:
            while not self._stop.wait(interval_s):
                found = descendants(self.root)
                with self._changed:
                    self.seen.update(found)
                    self._changed.notify_all()
                if not found and not Path(f"/proc/{self.root}").exists():
                    return
        finally:
            with self._changed:
                self._changed.notify_all()

    def _saw(self, program: str) -> bool:
        """A process whose program (its first two words: the executable, or python's script) ends in `program`."""
        return any(word.endswith(program) for cmd in self.seen.values() for word in cmd.split()[:2])

    def wait_for(self, program: str, timeout_s: float) -> bool:
        """True once a descendant runs `program`; False if `root` ended or `timeout_s` passed first."""
        with self._changed:
            self._changed.wait_for(lambda: self._saw(program) or not self._thread.is_alive(), timeout_s)
            return self._saw(program)

    def left_running(self, timeout_s: float = 20.0) -> dict[int, str]:
        """Stops watching; what is still alive of everything seen, once all of it ended or `timeout_s` passed
        (processes whose parent died notice it within a few seconds)."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + timeout_s
        while any(alive(pid, cmd) for pid, cmd in self.seen.items()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {pid: cmd for pid, cmd in self.seen.items() if alive(pid, cmd)}
