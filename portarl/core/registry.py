"""Name -> function registries (advantage estimators, policy losses), extensible by users.

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(rewards, groups, *, eps): ...
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str, *, replace: bool = False) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; re-registering needs ``replace=True``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorate(fn: F) -> F:
            if name in self._items and not replace:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to override it")
            self._items[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._items))}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
