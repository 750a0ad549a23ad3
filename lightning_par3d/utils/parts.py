"""An object's attribute that is one of its parts' (composition with the owner's public names kept).

:class:`~lightning_par3d.engine.Par3DEngine` is a facade over parts that each do one job (where this rank is, the
checkpoints, …); ``engine.layout`` and ``engine.save(...)`` stay the engine's names while the placement and the
saves own them::

    class Engine:
        layout = PartOf[Layout]("placement")     # engine.layout is engine.placement.layout
"""

from __future__ import annotations

from typing import Generic, TypeVar, overload

T = TypeVar("T")


class PartOf(Generic[T]):
    """The attribute of the same name of the owner's part ``part`` (an attribute of the owner): read there, and
    written there (for the settings a front-end changes, such as the engine's ``config``)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, owner_object: None, owner: type) -> PartOf[T]: ...
    @overload
    def __get__(self, owner_object: object, owner: type) -> T: ...
    def __get__(self, owner_object: object | None, owner: type) -> PartOf[T] | T:
        if owner_object is None:
            return self
        value: T = getattr(getattr(owner_object, self.part), self.name)
        return value

    def __set__(self, owner_object: object, value: T) -> None:
        setattr(getattr(owner_object, self.part), self.name, value)

    def __repr__(self) -> str:
        return f"PartOf({self.part!r}).{self.name}"


def parts_of(owner: type) -> dict[str, str]:
    """``{name: part}`` for every :class:`PartOf` attribute of the class ``owner`` (its MRO included)."""
    found: dict[str, str] = {}
    for cls in reversed(owner.__mro__):
        found.update({name: v.part for name, v in vars(cls).items() if isinstance(v, PartOf)})
    return found


__all__ = ["PartOf", "parts_of"]
