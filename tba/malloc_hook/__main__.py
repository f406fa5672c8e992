"""``python -m tba.malloc_hook``: where the hook library is, and what it did in this process.

    LD_PRELOAD=$(python -m tba.malloc_hook --path) torchrun train.py   # or $(tba hook --path)
    env $(python -m tba.malloc_hook --env) torchrun train.py   # also points the hook at cuFile
    LD_PRELOAD=$(python -m tba.malloc_hook --path) python -m tba.malloc_hook --status
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tba.malloc_hook._errors import MallocHookError
from tba.malloc_hook._library import cufile_library_path, library_path
from tba.malloc_hook._status import status


def _env_assignments() -> str:
    assignments = [f"LD_PRELOAD={library_path()}"]
    cufile = cufile_library_path()
    if cufile is not None:
        assignments.append(f"TBA_HOOK_CUFILE_LIBRARY={cufile}")
    return " ".join(assignments)


def main(argv: list[str] | None = None, *, prog: str = "python -m tba.malloc_hook") -> int:
    """Runs the command line (``tba hook`` is the same); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Locate the CUDA malloc hook that registers CUDA allocations with cuFile.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--path", action="store_true", help="print the library's path, for LD_PRELOAD")
    action.add_argument(
        "--env",
        action="store_true",
        help="print LD_PRELOAD=... and, when the nvidia-cufile wheel is installed, "
        f"TBA_HOOK_CUFILE_LIBRARY=..., for `env $({prog} --env) COMMAND`",
    )
    action.add_argument(
        "--status",
        action="store_true",
        help="print this process's hook status as JSON (run under LD_PRELOAD to check the preload)",
    )
    args = parser.parse_args(argv)
    try:
        if args.path:
            print(library_path())
        elif args.env:
            print(_env_assignments())
        else:
            print(json.dumps(dataclasses.asdict(status()), indent=2))
    except MallocHookError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
