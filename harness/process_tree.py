"""The process tree below a pid, read from /proc (Linux; no extra dependency): what the fault soak and the
tests use to find the router, Ray workers and LoadGen processes a harness run started."""

from __future__ import annotations

import collections
import os
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
