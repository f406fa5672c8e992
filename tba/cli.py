"""The ``tba`` command: one entry point for tba's tools.

    tba plan --model llama3-8b --gpu h100 --drive optane-p5800x-1.6tb   # feasibility on paper
    tba rok --quick --out /tmp/rok                                       # ROK curve, measured
    LD_PRELOAD=$(tba hook --path) torchrun train.py                      # cuFile registration
    tba check my_checks:tiny_model --offloader ssd --force               # parity on your model

Each subcommand takes ``--help``. ``python -m tba.plan`` and ``python -m tba.malloc_hook``
run the same code as ``tba plan`` and ``tba hook``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["main"]


def _plan(argv: list[str], prog: str) -> int:
    from tba.plan._cli import main

    return main(argv, prog=prog)


def _hook(argv: list[str], prog: str) -> int:
    from tba.malloc_hook.__main__ import main

    return main(argv, prog=prog)


def _check(argv: list[str], prog: str) -> int:
    from tba.testing._cli import main

    return main(argv, prog=prog)


def _rok(argv: list[str], prog: str) -> int:
    from tba.rok import main

    return main(argv, prog=prog)


_COMMANDS: dict[str, tuple[Callable[[list[str], str], int], str]] = {
    "plan": (_plan, "estimate activation bytes, write bandwidth and SSD lifetime (GPT/BERT/T5/Llama presets)"),
    "rok": (_rok, "measure Recompute / Offload / Keep curves (activation peak vs throughput)"),
    "check": (_check, "train MODULE:FACTORY's model with and without tba and compare bit for bit"),
    "hook": (_hook, "locate the CUDA malloc hook for LD_PRELOAD (--path | --env | --status)"),
}


def _usage() -> str:
    width = max(map(len, _COMMANDS))
    lines = ["usage: tba COMMAND [options]   (tba COMMAND --help for a command's options)", "",
             "Offload PyTorch training activations to NVMe SSD or host memory: tba's tools.", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in _COMMANDS.items()]
    lines += ["", "options:", "  -h, --help  show this message and exit", "  --version   print tba's version and exit"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs ``tba COMMAND ...``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from tba import __version__

        print(f"tba {__version__}")
        return 0
    command = _COMMANDS.get(argv[0])
    if command is None:
        print(f"tba: unknown command {argv[0]!r}; choose from {', '.join(_COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    return command[0](argv[1:], f"tba {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
