"""What MLCommons' truncate_accuracy_log.py does, per accuracy dir: append the accuracy log's sha256 to
accuracy.txt as a `hash=` line, then cut the log to its first and last 4 KiB when it exceeds 10 KiB."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import sys
from pathlib import Path

from audit.rules.rounds import ACCURACY_HASH_PATTERN, ACCURACY_LOG_VIEWABLE_SIZE, MAX_ACCURACY_LOG_SIZE, MODEL

log = logging.getLogger(__name__)

ELLIPSIS = b"\n\n...\n\n"


class MissingAccuracyTxt(FileNotFoundError):
    """accuracy.txt must be written (audit.accuracy) before the accuracy log is truncated."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def truncate_accuracy_dir(accuracy_dir: Path) -> bool:
    """Hashes and truncates one accuracy dir; returns False when it was already done (idempotent).

    Like the official tool it leaves a dir alone whose accuracy.txt already has a `hash=` line and whose
    log is under 10 KiB; otherwise it appends `\\nhash=<sha256 of the full log>\\n` and truncates.
    """
    accuracy_dir = Path(accuracy_dir)
    acc_txt = accuracy_dir / "accuracy.txt"
    acc_log = accuracy_dir / "mlperf_log_accuracy.json"
    if not acc_txt.is_file():
        raise MissingAccuracyTxt(f"{acc_txt} missing, generate it (audit.accuracy) before truncating")
    if not acc_log.is_file():
        raise FileNotFoundError(f"{acc_log} missing: nothing to hash")
    has_hash = re.search(ACCURACY_HASH_PATTERN, acc_txt.read_text(encoding="utf-8"), re.MULTILINE)
    size = acc_log.stat().st_size
    if has_hash and size < MAX_ACCURACY_LOG_SIZE:
        log.debug("%s already hashed and small (%d bytes)", accuracy_dir, size)
        return False
    digest = sha256_of(acc_log)
    with acc_txt.open("a", encoding="utf-8") as f:
        f.write(f"\nhash={digest}\n")
    if size > MAX_ACCURACY_LOG_SIZE:
        _truncate_file(acc_log, size)
    log.info("%s: hash appended, log %d bytes%s", accuracy_dir, size,
             " (truncated)" if size > MAX_ACCURACY_LOG_SIZE else "")
    return True


def _truncate_file(path: Path, size: int) -> None:
    with path.open("rb") as f:
        head = f.read(ACCURACY_LOG_VIEWABLE_SIZE)
        f.seek(size - ACCURACY_LOG_VIEWABLE_SIZE)
        tail = f.read(ACCURACY_LOG_VIEWABLE_SIZE)
    tmp = path.with_name(f".{path.name}.truncating")
    tmp.write_bytes(head + ELLIPSIS + tail)
    os.replace(tmp, path)


def truncate_submission(tree: Path) -> list[Path]:
    """Runs `truncate_accuracy_dir` on every `<div>/<sub>/results/<sys>/<model>/<scen>/accuracy`; returns the
    dirs it changed."""
    changed = []
    for acc_dir in sorted(Path(tree).glob(f"*/*/results/*/{MODEL}/*/accuracy")):
        if acc_dir.is_dir() and truncate_accuracy_dir(acc_dir):
            changed.append(acc_dir)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audit.truncate", description=__doc__)
    parser.add_argument("tree", type=Path, help="submission tree: the directory holding closed/ and/or open/")
    args = parser.parse_args(argv)
    try:
        changed = truncate_submission(args.tree)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(f"hashed/truncated {d}" for d in changed) or "nothing to do: every accuracy log done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
