"""One registry pattern for tiers, eviction policies and admission policies.

Modelled on fsspec's registry: a name maps either to a class or to a lazy
``"module:attr"`` import path (so optional dependencies are imported only when
used, with an install hint when they are missing); an unknown name lists the
known ones; third parties register through the ``kvstrata.<kind>`` entry-point
group.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from kvstrata.errors import ConfigError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of classes of one kind (``tier``, ``eviction``, ``admission``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, type[T] | str] = {}
        self._hints: dict[str, str] = {}
        self._entry_points_loaded = False

    def register(
        self, name: str, target: type[T] | str | None = None, *, install_hint: str = ""
    ) -> Callable[[type[T]], type[T]]:
        """Register ``target`` (a class or ``"module:attr"``) under ``name``.

        Usable as a decorator: ``@registry.register("lru")``.
        """
        if install_hint:
            self._hints[name] = install_hint

        def deco(cls: type[T]) -> type[T]:
            self._entries[name] = cls
            return cls

        if target is not None:
            self._entries[name] = target
        return deco

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        """Return the class registered as ``name``; import it lazily if needed."""
        self._load_entry_points()
        target = self._entries.get(name)
        if target is None:
            known = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}", field=self.kind, value=name)
        if isinstance(target, str):
            module_name, _, attr = target.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                hint = self._hints.get(name, "")
                raise ConfigError(
                    f"{self.kind} {name!r} needs an optional dependency that is not installed ({exc})"
                    + (f"; install it with: {hint}" if hint else ""),
                    field=self.kind,
                    value=name,
                ) from exc
            target = getattr(module, attr)
            self._entries[name] = target
        return target  # type: ignore[return-value]

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=f"kvstrata.{self.kind}"):
            self._entries.setdefault(ep.name, ep.value)
