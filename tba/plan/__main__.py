"""``python -m tba.plan``: the planner's command line (same as ``tba plan``)."""

from __future__ import annotations

import sys

from tba.plan._cli import main

if __name__ == "__main__":
    sys.exit(main())
