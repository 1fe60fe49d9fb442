"""`python -m audit TREE [--version v6.1] [--submitter X]`: prints one line per rule and a verdict;
exits 1 when the submission would be rejected, 2 when the tree cannot be audited at all. TREE is the
directory holding closed/ (and/or open/) or one <division>/<submitter>/ directory inside it."""

from __future__ import annotations

import argparse
import sys

from audit.checker import audit_tree
from audit.rules.rounds import DEFAULT_VERSION, ROUNDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audit", description=__doc__)
    parser.add_argument("tree", help="submission tree: the directory holding closed/ (and/or open/), e.g. "
                                     "OUTPUT/submission, or one submission in it, e.g. "
                                     "OUTPUT/submission/closed/<submitter> (audits only that one)")
    parser.add_argument("--version", default=DEFAULT_VERSION, choices=sorted(ROUNDS),
                        help="submission round whose rules apply (default %(default)s)")
    parser.add_argument("--submitter", help="audit only <division>/<SUBMITTER>/")
    args = parser.parse_args(argv)
    try:
        report = audit_tree(args.tree, version=args.version, submitter=args.submitter)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    return 0 if report.accepted else 1


if __name__ == "__main__":
    sys.exit(main())
