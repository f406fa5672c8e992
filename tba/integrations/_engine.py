"""`Engine`: the one record every pipeline integration keeps, and the skeleton they share.

Each pipeline integration (:mod:`~tba.integrations.torch_pipelining`,
:mod:`~tba.integrations.megatron`, :mod:`~tba.integrations.deepspeed`) is one :class:`Engine`:
its name, how to import it, the versions it was checked against, the replacements it made
(a :class:`~tba.integrations._patching.PatchSet`) and the scheduler runs in progress in this
process. Its module's ``patch()`` / ``unpatch()`` / ``is_patched()`` are this class's; the module
supplies only what differs: which internals to check (``check``) and how to wrap them
(``install``), with :meth:`Engine.record_runs` and :func:`wrapper` for the wrappers.

The trainer callbacks (:mod:`~tba.integrations.hf`, :mod:`~tba.integrations.lightning`) patch
nothing; they share :func:`import_extra` for the error that names the ``pip install`` to run.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, Generic, TypeVar

from tba.integrations._patching import (
    IntegrationVersionError,
    PatchSet,
    VersionRange,
    _mismatch,
    installed_version,
    require_attr,
    require_params,
    warn_if_untested,
)

__all__ = ["Engine", "wrapper", "import_extra"]

Targets = TypeVar("Targets")
Run = TypeVar("Run")
# Replacements take and return whatever the engine's originals do.
F = TypeVar("F", bound=Callable[..., Any])


def import_extra(module: str, what: str, extra: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError naming ``pip install 'tba[extra]'``.

    Example:
        >>> transformers = import_extra("transformers", "tba.integrations.hf", "hf")  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs {module}: pip install 'tba[{extra}]'") from exc


def wrapper(original: Callable[..., object]) -> Callable[[F], F]:
    """Decorator for a replacement of ``original``: copies its name and docstring and records
    it as ``__tba_original__`` (what the tests and a later patch on top of ours can follow)."""

    def decorate(replacement: F) -> F:
        functools.update_wrapper(replacement, original)  # in place
        setattr(replacement, "__tba_original__", original)
        return replacement

    return decorate


class Engine(Generic[Targets, Run]):
    """One pipeline engine's integration: how to patch it, and what its patch holds.

    ``Targets`` is what ``check`` finds and ``install`` patches; ``Run`` the record of one
    scheduler run in progress (see :meth:`record_runs`).

    Args:
        name: the name in messages (``tba.integrations.<name>``).
        tested: the versions the integration was run against.
        module: the engine's top-level module, imported by :meth:`patch`.
        distribution: the distribution whose installed version is checked against ``tested``.
        check: ``check(version)`` verifies every internal the wrappers rely on (raising
            :class:`IntegrationVersionError` through :meth:`require_attr` /
            :meth:`require_params`) and returns what ``install`` patches. Runs before anything
            is replaced, so a mismatch patches nothing.
        install: ``install(targets)`` makes the replacements through :attr:`patches`.
    """

    def __init__(
        self,
        name: str,
        tested: VersionRange,
        *,
        module: str,
        distribution: str,
        check: Callable[[str], Targets],
        install: Callable[[Targets], None],
    ) -> None:
        self.name = name
        self.tested = tested
        self._module = module
        self._distribution = distribution
        self._check = check
        self._install = install
        self.patches = PatchSet(name)
        #: Scheduler runs in progress in this process, innermost last (see record_runs).
        self.runs: list[Run] = []

    # ------------------------------------------------------------------ patch state
    def is_patched(self) -> bool:
        return self.patches.active

    def patch(self) -> None:
        """Check the installed engine and install the wrappers. Idempotent.

        Raises:
            ImportError: the engine is not installed (names ``pip install 'tba[integrations]'``).
            IntegrationVersionError: its internals differ from the checked ones.
        """
        if self.patches.active:
            return
        module = import_extra(self._module, f"tba.integrations.{self.name}", "integrations")
        version = installed_version(self._distribution, module)
        targets = self._check(version)
        warn_if_untested(self.name, version, self.tested)
        try:
            self._install(targets)
        except BaseException:
            self.patches.restore()  # never leave half a patch behind
            raise

    def unpatch(self) -> None:
        """Restore every original and forget the runs in progress. Idempotent."""
        self.patches.restore()
        self.runs.clear()

    # ------------------------------------------------------------------ checks
    def require_attr(self, owner: object, name: str, version: str) -> Any:
        """``getattr(owner, name)``, or :class:`IntegrationVersionError` naming this engine.

        The result is an internal of the engine, of a type tba does not know (``Any``)."""
        return require_attr(owner, name, self.name, version, self.tested)

    def require_params(
        self,
        func: Callable[..., object],
        params: Iterable[str],
        version: str,
        *,
        positional_prefix: Iterable[str] | None = None,
    ) -> None:
        """Check ``func`` takes ``params`` (and starts with ``positional_prefix``)."""
        require_params(
            func, params, self.name, version, self.tested, positional_prefix=positional_prefix
        )

    def mismatch(self, version: str, what: str) -> IntegrationVersionError:
        """The error for any other difference from the checked internals."""
        return _mismatch(self.name, version, self.tested, what)

    # ------------------------------------------------------------------ runs
    def record_runs(
        self, original: Callable[..., object], make_run: Callable[..., Run | None]
    ) -> Callable[..., object]:
        """Wrap a scheduler entry point so each call is recorded in :attr:`runs` while it runs.

        ``make_run(*args, **kwargs)`` builds the run record from the call's arguments (the
        rank's plan, ...); ``None`` runs ``original`` unrecorded.
        """

        @wrapper(original)
        def run_recorded(*args: object, **kwargs: object) -> object:
            run = make_run(*args, **kwargs)
            if run is None:
                return original(*args, **kwargs)
            self.runs.append(run)
            try:
                return original(*args, **kwargs)
            finally:
                self.runs.remove(run)

        return run_recorded

    def current_run(self, matches: Callable[[Run], bool] | None = None) -> Run | None:
        """The innermost run in progress (that ``matches``), or ``None``."""
        for run in reversed(self.runs):
            if matches is None or matches(run):
                return run
        return None
