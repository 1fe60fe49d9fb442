"""`python -m harness ...`: see harness/cli.py (run_submission.sh execs this)."""

import sys

from harness.cli import main

sys.exit(main())
