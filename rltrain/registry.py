"""A small named registry for pluggable pieces (advantage estimators, reward scorers, ...).

    ADVANTAGES = Registry("advantage estimator")
    @ADVANTAGES.register("grpo")
    def grpo(...): ...
    ADVANTAGES.get("grpo")      # unknown name -> ValueError listing the known ones

Registering a name twice is an error: two plug-ins claiming one name is always a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
