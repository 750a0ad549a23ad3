"""Every change par3d makes to the objects of a user's model, made (and undone) here.

par3d applies torch's own parallelisms to the model in place (DTensor parameters, FSDP2's ``FSDP<Class>`` classes,
``DistributedDataParallel`` around pure replication); those are torch's, documented by torch. What par3d adds on
top goes through these functions, so that one module says what a model looks like after ``setup``, and
:func:`undo` can take it back:

* :func:`swap_class`: a module's class becomes a subclass made of a par3d mixin and the module's own class
  (``Pipelined<Trunk>`` for a pipelined trunk, whose call defers to the schedule; ``Checkpointed<Block>`` for an
  activation-checkpointed block). The subclasses are made once per (mixin, class) and cached, as FSDP2 caches its
  own, so ``type(a) is type(b)`` holds for two blocks of one class and models built again reuse the classes;
* :func:`set_attribute`: an instance attribute that shadows a method of the class (the pipelined loss method;
  Accelerate's autocast ``forward``); the class's own method comes back with :func:`undo`;
* :func:`temporarily`: an instance attribute for the duration of a call (``self.log`` while the pipelined loss
  runs on the last stage, to relay what it logs to the other stages);
* :func:`remember`: what par3d did to a module (its layout and pipeline), kept weakly so that a parallelized
  model is recognised when it is given to par3d again and is freed when the user drops it.

docs/architecture.md ("What par3d does to your model") lists every change a user can observe.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_CLASSES: dict[tuple[type, type], type] = {}
"""The subclasses :func:`swap_class` made, by (mixin, original class)."""
_ORIGINAL_CLASS: weakref.WeakKeyDictionary[nn.Module, type] = weakref.WeakKeyDictionary()
_MISSING = object()
_SHADOWED: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Per module, the instance attributes :func:`set_attribute` set, with what the instance held before (or
``_MISSING``)."""
_RECORDS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Gives ``module`` the class ``<prefix><Class>(mixin, Class)``, made once per (mixin, class); does nothing if
    the module already has the mixin."""
    if isinstance(module, mixin):
        return
    base = type(module)
    if (mixin, base) not in _CLASSES:
        _CLASSES[(mixin, base)] = type(f"{prefix}{base.__name__}", (mixin, base), {})
    _ORIGINAL_CLASS.setdefault(module, base)
    module.__class__ = _CLASSES[(mixin, base)]


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before :func:`swap_class` (its own class if par3d changed none)."""
    return _ORIGINAL_CLASS.get(module, type(module))


def set_attribute(module: nn.Module, name: str, value: Any) -> None:
    """Sets the instance attribute ``name`` (bypassing ``nn.Module.__setattr__``, so a module value is not
    registered as a child), remembering what the instance held before for :func:`undo`."""
    shadowed = _SHADOWED.setdefault(module, {})
    shadowed.setdefault(name, module.__dict__.get(name, _MISSING))
    module.__dict__[name] = value


def restore_attribute(module: nn.Module, name: str) -> None:
    """Takes back what :func:`set_attribute` set as ``name`` on ``module`` (nothing if it set nothing)."""
    shadowed = _SHADOWED.get(module, {})
    if name not in shadowed:
        return
    before = shadowed.pop(name)
    if before is _MISSING:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = before


@contextmanager
def temporarily(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    """The instance attribute ``name`` set to ``value`` inside the block, and as it was after it."""
    before = module.__dict__.get(name, _MISSING)
    module.__dict__[name] = value
    try:
        yield
    finally:
        if before is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = before


def remember(module: nn.Module, record: Any) -> None:
    """Keeps ``record`` (what par3d did to ``module``) for as long as the module lives."""
    _RECORDS[module] = record


def record_of(module: nn.Module) -> Any:
    """What par3d did to ``module`` (see :func:`remember`), or None."""
    return _RECORDS.get(module)


def changes(module: nn.Module) -> list[str]:
    """What par3d changed on ``module`` and its submodules, one line each (for a person)."""
    lines = []
    for name, sub in module.named_modules():
        where = name or type(module).__name__
        if sub in _ORIGINAL_CLASS:
            lines.append(f"{where}: class {_ORIGINAL_CLASS[sub].__name__} → {type(sub).__name__}")
        lines += [f"{where}.{attr}: set by par3d" for attr in _SHADOWED.get(sub, {})]
    return lines


def undo(module: nn.Module) -> None:
    """Takes back, on ``module`` and its submodules, the classes and attributes par3d changed here (torch's own
    parallelisms stay: a sharded model stays sharded, and a class FSDP2 subclassed after par3d's stays). The module
    is no longer recognised as parallelized."""
    for sub in module.modules():
        for name, before in _SHADOWED.pop(sub, {}).items():
            if before is _MISSING:
                sub.__dict__.pop(name, None)
            else:
                sub.__dict__[name] = before
        original = _ORIGINAL_CLASS.pop(sub, None)
        if original is not None and type(sub) in _CLASSES.values():  # not when torch (FSDP2) subclassed it since
            sub.__class__ = original
        _RECORDS.pop(sub, None)
