"""``tba check MODULE:FACTORY``: :func:`tba.testing.check_parity` from the command line.

    tba check my_project.checks:tiny_model --offloader ssd --ssd-dir /mnt/nvme --force
    tba check path/to/file.py:make --chaos --steps 4 -o min_offload_bytes=0

The factory contract: ``FACTORY()`` is called with no arguments and returns either
``(model, batches)`` or a dict with the keys ``model`` and ``batches`` and, optionally,
``loss_fn``, ``optimizer`` (as :func:`tba.testing.check_parity` takes them) and ``options``
(a dict of :func:`tba.configure_tensor_cache` options). Options on the command line win over
the factory's. The exit status is 0 when the check passes, 1 when it fails (a difference, an
error only the model with tba raised, or no byte moved), 2 on a usage error. The cache checks
its bookkeeping after every step (``TBA_CHECK_INVARIANTS=1`` unless set otherwise).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import itertools
import logging
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = ["main"]

_FACTORY_KEYS = ("model", "batches", "loss_fn", "optimizer", "options")


class _UsageError(Exception):
    """A problem with what the command was given (exit status 2)."""


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a model and a copy of it with tba on the same batches and compare every "
                    "loss, gradient, parameter and buffer bit for bit (tba.testing.check_parity). "
                    "Fails when anything differs or when no byte was offloaded and read back.",
        epilog="FACTORY() returns (model, batches) or a dict with model, batches and optionally "
               "loss_fn, optimizer, options (tba.configure_tensor_cache options); command-line "
               "options win. Exit status: 0 pass, 1 fail, 2 usage error.",
    )
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a module (dotted name, importable from the current directory) or a .py "
                             "file, and the function in it that builds the model and its batches")
    parser.add_argument("--offloader", choices=("host", "ssd", "host+ssd", "none"),
                        help="where the copy's activations go (default: the factory's, else host)")
    parser.add_argument("--ssd-dir", action="append", dest="ssd_dirs", metavar="DIR",
                        help="directory for --offloader ssd or host+ssd (repeat to stripe)")
    parser.add_argument("--force", action="store_true",
                        help="send every saved tensor out (min_offload_bytes=0, adaptive off, no kept "
                             "tail, the model's devices offloaded)")
    parser.add_argument("--chaos", action="store_true", help="delay every transfer at random")
    parser.add_argument("--chaos-max-delay-ms", type=float, default=30.0, metavar="MS",
                        help="longest chaos delay (default 30)")
    parser.add_argument("--steps", type=int, metavar="N", help="use only the first N batches")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random generators (default 0)")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                        help="any tba.configure_tensor_cache option, VALUE as a Python literal "
                             "(-o min_offload_bytes=0 -o offload_devices=\"('cpu',)\"); repeatable")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the report")
    return parser


def _import(module_name: str) -> ModuleType:
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise _UsageError(f"no such file: {module_name}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0], module_name)
        assert spec is not None and spec.loader is not None, "a .py file always has a loader"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m`` does
    return importlib.import_module(module_name)


def _load(target: str) -> dict[str, Any]:
    """Import ``MODULE:FACTORY``, call the factory, return its parts by name."""
    module_name, sep, factory_name = target.rpartition(":")
    if not sep or not module_name or not factory_name:
        raise _UsageError(f"expected MODULE:FACTORY (e.g. my_checks:tiny_gpt2), got {target!r}")
    try:
        module = _import(module_name)
    except ImportError as exc:
        raise _UsageError(f"cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise _UsageError(f"{module_name!r} has no function {factory_name!r}")
    made = factory()
    if isinstance(made, tuple) and len(made) == 2:
        return {"model": made[0], "batches": made[1]}
    if isinstance(made, Mapping):
        unknown = sorted(set(made) - set(_FACTORY_KEYS))
        missing = [k for k in ("model", "batches") if k not in made]
        if unknown or missing:
            raise _UsageError(
                f"{target} returned a dict with unknown keys {unknown} / missing keys {missing}; "
                f"expected model, batches and optionally {', '.join(_FACTORY_KEYS[2:])}"
            )
        return dict(made)
    raise _UsageError(f"{target} returned a {type(made).__name__}; expected (model, batches) or a "
                      f"dict with keys {', '.join(_FACTORY_KEYS)}")


def _parse_option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise _UsageError(f"-o {text!r}: expected NAME=VALUE (e.g. -o min_offload_bytes=0)")
    try:
        return name.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name.strip(), value  # a bare word: a string (-o ssd_engine=posix)


def main(argv: list[str] | None = None, prog: str = "tba check") -> int:
    """Runs ``tba check``; returns the exit status."""
    args = _parser(prog).parse_args(argv)
    try:
        made = _load(args.target)
        options = dict(made.get("options") or {})
        options.update(_parse_option(text) for text in args.option)
        if args.offloader is not None:
            options["offloader"] = args.offloader
        if args.ssd_dirs:
            options["ssd_dirs"] = tuple(args.ssd_dirs)
        if args.steps is not None and args.steps < 1:
            raise _UsageError(f"--steps {args.steps}: expected a number of steps >= 1")
        batches = list(itertools.islice(made["batches"], args.steps))
    except _UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    from tba.testing._parity import check_parity

    # The cache checks its own bookkeeping after every step too (an explicit setting wins).
    os.environ.setdefault("TBA_CHECK_INVARIANTS", "1")
    model = made["model"]
    if not args.quiet:
        print(f"{prog}: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters), "
              f"{len(batches)} steps, options {options or '{}'}"
              + (", force" if args.force else "") + (", chaos" if args.chaos else ""), file=sys.stderr)
    progress = logging.StreamHandler(sys.stderr)
    progress.setLevel(logging.INFO)
    parity_logger = logging.getLogger("tba.testing._parity")
    level = parity_logger.level
    if not args.quiet:
        parity_logger.addHandler(progress)
        parity_logger.setLevel(logging.INFO)
    try:
        report = check_parity(
            model, batches, loss_fn=made.get("loss_fn"), optimizer=made.get("optimizer"),
            force=args.force, chaos=args.chaos, chaos_max_delay_s=args.chaos_max_delay_ms / 1000,
            seed=args.seed, **options,
        )
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    finally:
        parity_logger.removeHandler(progress)
        parity_logger.setLevel(level)
    print(report)
    return 0 if report.ok else 1
