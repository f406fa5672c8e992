"""Reversible, idempotent monkey-patching with structural checks of the patched internals.

Every integration patches private internals of another library. Before replacing anything it
checks that each attribute exists with the parameters the wrapper relies on; if not, it raises
:class:`IntegrationVersionError` naming the installed version and the tested range, and
patches nothing. A version outside the tested range whose internals still match gets a
one-time warning, not an error.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from tba.errors import TBAError

__all__ = [
    "IntegrationVersionError",
    "PatchSet",
    "VersionRange",
    "installed_version",
    "require_attr",
    "require_params",
]

logger = logging.getLogger(__name__)

_MISSING = object()
K = TypeVar("K")
V = TypeVar("V")


class IntegrationVersionError(TBAError):
    """The installed library's internals are not what a tba integration was written against."""


@dataclass(frozen=True)
class VersionRange:
    """``[low, high)`` of release numbers, e.g. ``VersionRange("2.13", "2.14")``."""

    low: str
    high: str

    def __contains__(self, version: str) -> bool:
        v, low, high = _release(version), _release(self.low), _release(self.high)
        return v is not None and low is not None and high is not None and low <= v < high

    def __str__(self) -> str:
        return f">={self.low},<{self.high}"


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        return None
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def installed_version(distribution: str, module: ModuleType | None = None) -> str:
    """Version of ``distribution`` as installed, falling back to ``module.__version__``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def _mismatch(
    engine: str, version: str, tested: VersionRange, what: str
) -> IntegrationVersionError:
    return IntegrationVersionError(
        f"tba.integrations.{engine}: {what}. The installed version is {version}; tba's "
        f"{engine} integration was checked against {tested}. Install a tested version "
        "(pip install 'tba[integrations]'), or drive the cache yourself with "
        "cache.set_stage(...) instead of patch()."
    )


def require_attr(owner: object, name: str, engine: str, version: str, tested: VersionRange) -> Any:
    """``getattr(owner, name)``, or :class:`IntegrationVersionError` if it does not exist.

    The result is an internal of another library, of a type tba does not know (``Any``)."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        owner_name = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
        raise _mismatch(engine, version, tested, f"{owner_name}.{name} does not exist")
    return value


def require_params(
    func: Callable[..., object],
    params: Iterable[str],
    engine: str,
    version: str,
    tested: VersionRange,
    *,
    positional_prefix: Iterable[str] | None = None,
) -> None:
    """Check ``func`` accepts every name in ``params`` (and, if given, that its leading
    positional parameters are exactly ``positional_prefix``, in order)."""
    qualname = getattr(func, "__qualname__", repr(func))
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise _mismatch(
            engine, version, tested, f"cannot read the signature of {qualname}"
        ) from exc
    names = list(signature.parameters)
    missing = [p for p in params if p not in signature.parameters]
    if missing:
        raise _mismatch(
            engine,
            version,
            tested,
            f"{qualname}{signature} has no parameter(s) {', '.join(missing)}",
        )
    if positional_prefix is not None:
        prefix = list(positional_prefix)
        if names[: len(prefix)] != prefix:
            raise _mismatch(
                engine,
                version,
                tested,
                f"{qualname}{signature} does not start with ({', '.join(prefix)})",
            )


_warned: set[tuple[str, str]] = set()


def warn_if_untested(engine: str, version: str, tested: VersionRange) -> None:
    """One warning per process for a version outside ``tested`` whose internals still match."""
    if version in tested or (engine, version) in _warned:
        return
    _warned.add((engine, version))
    logger.warning(
        "tba.integrations.%s: installed version %s is outside the tested range %s; the "
        "patched internals look as expected, continuing",
        engine,
        version,
        tested,
    )


class _Replacement(Protocol):
    """One replacement :class:`PatchSet` made, and how to undo it."""

    @property
    def replacement(self) -> object: ...

    def current(self) -> object:
        """What is there now (our replacement, unless someone patched on top of it)."""
        ...

    def undo(self) -> None: ...

    def describe(self) -> str: ...


@dataclass
class _AttrReplacement:
    owner: object
    name: str
    original: object  # raw value (class __dict__ entry) or _MISSING if it was inherited
    replacement: object

    def current(self) -> object:
        if isinstance(self.owner, type):
            return vars(self.owner).get(self.name, _MISSING)
        return getattr(self.owner, self.name, _MISSING)

    def undo(self) -> None:
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)

    def describe(self) -> str:
        return f"{_name_of(self.owner)}.{self.name}"


@dataclass
class _ItemReplacement(Generic[K, V]):
    mapping: MutableMapping[K, V]
    key: K
    original: V
    replacement: V

    def current(self) -> object:
        return self.mapping[self.key]

    def undo(self) -> None:
        self.mapping[self.key] = self.original

    def describe(self) -> str:
        return f"{_name_of(self.mapping)}[{self.key!r}]"


def _name_of(owner: object) -> str:
    return str(getattr(owner, "__qualname__", getattr(owner, "__name__", type(owner).__name__)))


class PatchSet:
    """The replacements one integration made, so :meth:`restore` can undo them exactly."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._replacements: list[_Replacement] = []

    @property
    def active(self) -> bool:
        return bool(self._replacements)

    def replace_attr(self, owner: object, name: str, replacement: object) -> None:
        """``setattr(owner, name, replacement)``, remembering the raw previous value."""
        raw = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        if raw is _MISSING and not isinstance(owner, type):
            raw = getattr(owner, name)
        setattr(owner, name, replacement)
        self._replacements.append(_AttrReplacement(owner, name, raw, replacement))

    def replace_item(self, mapping: MutableMapping[K, V], key: K, replacement: V) -> None:
        """``mapping[key] = replacement``, remembering the previous value."""
        record: _ItemReplacement[K, V] = _ItemReplacement(mapping, key, mapping[key], replacement)
        self._replacements.append(record)
        mapping[key] = replacement

    def restore(self) -> None:
        """Undo every replacement, newest first.

        Raises:
            TBAError: someone else replaced one of our replacements after us; their patch would
                be lost, so nothing is restored. Undo theirs first.
        """
        for r in self._replacements:
            if r.current() is not r.replacement:
                raise TBAError(
                    f"tba.integrations.{self.engine}.unpatch(): {r.describe()} was replaced "
                    "again after tba patched it; undo that patch first"
                )
        for r in reversed(self._replacements):
            r.undo()
        self._replacements.clear()
