"""Name → implementation tables behind the extension seams (losses, advantage estimators,
tasks, graders): one lookup with a helpful error, one registration rule.

Imports: the standard library only (every layer may use it).
"""

from __future__ import annotations

import difflib
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """A ``dict`` of named implementations of one kind (``kind`` names it in errors)."""

    def __init__(self, kind: str, base: type | None = None) -> None:
        super().__init__()
        self.kind, self.base = kind, base

    def add(self, name: str, item: T) -> T:
        """Register ``item`` as ``name``; registering the same item again is a no-op, a
        different one under a taken name is an error."""
        if not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")
        existing = self.get(name)
        if existing is not None and existing is not item:
            raise ValueError(f"a {self.kind} named {name!r} is already registered ({existing!r})")
        self[name] = item
        return item

    def add_class(self, cls: Any) -> Any:
        """Register a subclass of ``base`` under its ``name`` attribute (a class decorator)."""
        if self.base is not None and not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"a {self.kind} must subclass {self.base.__name__}, got {cls!r}")
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{cls.__name__} needs a class attribute 'name'")
        return self.add(name, cls)

    def lookup(self, name: str) -> T:
        """The item called ``name``; a ``ValueError`` suggests a close name and lists all."""
        if name in self:
            return self[name]
        close = difflib.get_close_matches(name, list(self), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; expected one of {sorted(self)}")
