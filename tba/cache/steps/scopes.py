"""Which modules are the cache's units (blocks and the modules around them), and scope records.

A *unit* is a module whose forward call opens a scope: every tensor saved while it runs belongs
to that scope. Units are the model's repeated blocks (children of its largest
``nn.ModuleList`` and of lists of the same block type, or ``block_modules``) plus the outermost modules that are neither blocks nor
contain one (embeddings, final norm, LM head). A forward pass of the root module is a *record*:
its scopes in forward order, which backward walks in reverse to prefetch.
"""

from __future__ import annotations

import fnmatch
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from tba.cache.engine.entries import Entry

__all__ = ["Unit", "find_units", "matches", "Scope", "Record", "ForwardPass"]


class Unit:
    """A module that opens scopes. ``block_index`` is its position among the blocks, or None.

    Note [Graphs do not own the model]: scopes (hence entries, hence autograd's handles) refer
    to their unit; the unit refers to its module only weakly, so a live graph never keeps the
    model, its hooks or its cache alive."""

    __slots__ = ("_module", "name", "block_index")

    def __init__(self, module: nn.Module, name: str, block_index: int | None) -> None:
        self._module = weakref.ref(module)
        self.name = name
        self.block_index = block_index

    @property
    def module(self) -> nn.Module:
        module = self._module()
        assert module is not None, f"tba bug: the module of unit {self.name!r} was collected"
        return module

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, block_index={self.block_index})"


#: Names a module: the instance, its type, or an ``fnmatch`` pattern of its qualified name.
ModuleSpec = nn.Module | type[nn.Module] | str


def matches(module: nn.Module, name: str, specs: tuple[ModuleSpec, ...]) -> bool:
    """Whether ``module`` (qualified ``name``) is named by ``specs``: instances, types, or
    ``fnmatch`` patterns of qualified names."""
    for spec in specs:
        if isinstance(spec, str):
            if fnmatch.fnmatchcase(name, spec):
                return True
        elif isinstance(spec, type):
            if isinstance(module, spec):
                return True
        elif spec is module:
            return True
    return False


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of the model's largest ``nn.ModuleList`` (by parameters), plus those of every
    other list holding the same block types (an encoder-decoder has two stacks)."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if not lists:
        return []
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in lists}
    best_name, best = max(lists, key=lambda item: (sizes[item[0]], len(item[1])))
    kinds = {type(child) for child in best}
    chosen: list[str] = []
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in lists:
        if {type(child) for child in module} != kinds:
            continue
        if any(name.startswith(outer + ".") for outer in chosen):
            continue  # a list inside a chosen block belongs to that block
        chosen.append(name)
        prefix = name + "." if name else ""
        blocks.extend((f"{prefix}{i}", child) for i, child in enumerate(module))
    return blocks


def find_units(model: nn.Module, block_specs: tuple[ModuleSpec, ...] | None) -> list[Unit]:
    """The units of ``model``: blocks first (in order), then the modules around them.

    Raises:
        ValueError: ``block_specs`` names no module of ``model``.
    """
    if block_specs is None:
        blocks = _repeated_blocks(model)
    else:
        blocks = [(n, m) for n, m in model.named_modules() if n and matches(m, n, block_specs)]
        # Blocks nested in other blocks are not units of their own.
        top: list[tuple[str, nn.Module]] = []
        for name, module in blocks:
            if not any(name.startswith(outer + ".") for outer, _ in top):
                top.append((name, module))
        blocks = top
        if not blocks:
            raise ValueError(
                f"block_modules={block_specs!r} matches no submodule of {type(model).__name__}; "
                "pass module instances, module types, or qualified-name patterns such as "
                "'transformer.h.*' (see model.named_modules())"
            )
    units = [Unit(module, name, index) for index, (name, module) in enumerate(blocks)]
    block_names = [name for name, _ in blocks]

    def contains_block(name: str) -> bool:
        prefix = name + "." if name else ""
        return any(b.startswith(prefix) for b in block_names)

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            qual = f"{name}.{child_name}" if name else child_name
            if qual in block_names:
                continue
            if contains_block(qual):
                visit(child, qual)
            else:
                units.append(Unit(child, qual, None))

    if blocks:
        visit(model, "")
    else:
        units.extend(Unit(child, name, None) for name, child in model.named_children())
    return units


class Scope:
    """One call of a unit in one forward pass: the entries it saved, in order."""

    __slots__ = ("record", "index", "unit", "keep", "entries", "backward_entered")

    def __init__(self, record: Record, index: int, unit: Unit | None, keep: bool) -> None:
        self.record = record
        self.index = index
        self.unit = unit
        self.keep = keep
        self.entries: list[Entry] = []
        self.backward_entered = False


class Record:
    """One forward pass of the model (one microbatch of one stage): its scopes in forward
    order, and where it stands (Note [Step boundaries] in tba/cache/steps/tracker.py)."""

    __slots__ = (
        "key", "seq", "scopes", "keep_tail", "in_tail", "forward_done", "backward_started",
        "backward_task", "backward_done", "num_handles", "detached", "grad_fn_hooks", "offloads",
    )

    def __init__(self, key: tuple[int, int], keep_tail: bool, seq: int = 0) -> None:
        self.key = key
        self.seq = seq  # order of the forwards
        self.scopes: list[Scope] = []
        self.keep_tail = keep_tail  # whether the last blocks stay in memory for this pass
        self.in_tail = False  # forward has reached the kept tail
        self.forward_done = False
        self.backward_started = False
        self.backward_task = -1  # the autograd graph task its backward last ran in
        self.backward_done = False
        self.num_handles = 0  # live handles of its saves: 0 after forward = its graph is gone
        self.detached = False  # its step ended (a later backward of it starts a step again)
        self.grad_fn_hooks: list[RemovableHandle] = []
        self.offloads = False  # an entry of it was marked for offload (Note [Prefetch hooks])


class ForwardPass:
    """The forward pass in progress: the record it fills, the units running (innermost last)
    and how many skipped modules are active. Scopes are created when a unit first saves."""

    def __init__(self) -> None:
        self.record: Record | None = None
        # [unit, scope or None, keep] per unit entered: a list (not an object) read per save.
        self.units: list[list[Any]] = []
        self.skip_depth = 0
        self._loose_scope: Scope | None = None  # tensors saved outside every unit

    def begin(self, record: Record) -> None:
        self.end()
        self.record = record

    def end(self) -> None:
        self.record = None
        self.units.clear()
        self.skip_depth = 0
        self._loose_scope = None

    def enter(self, unit: Unit, tail_start: int) -> None:
        record = self.record
        assert record is not None
        if record.keep_tail and unit.block_index is not None and unit.block_index >= tail_start:
            record.in_tail = True  # this block and everything after it stay in memory
        keep = record.in_tail or bool(self.units and self.units[-1][2])
        self.units.append([unit, None, keep])
        self._loose_scope = None

    def exit(self) -> Scope | None:
        """Leave the innermost unit; its scope, if it saved anything."""
        return self.units.pop()[1] if self.units else None

    def scope(self) -> Scope:
        """The scope a tensor saved now belongs to."""
        record = self.record
        assert record is not None
        if self.units:
            top = self.units[-1]
            scope: Scope | None = top[1]
            if scope is None:
                scope = top[1] = Scope(record, len(record.scopes), top[0], top[2])
                record.scopes.append(scope)
            return scope
        if self._loose_scope is None:
            self._loose_scope = Scope(record, len(record.scopes), None, record.in_tail)
            record.scopes.append(self._loose_scope)
        return self._loose_scope
