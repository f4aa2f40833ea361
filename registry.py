"""One registry pattern for tiers, eviction policies and admission policies.

Modelled on fsspec's registry: a name maps either to a class or to a lazy
``"module:attr"`` import path (so optional dependencies are imported only when
used, with an install hint when they are missing); an unknown name lists the
known ones; third parties register through the ``kvstrata.<kind>`` entry-point
group (``kvstrata.tier``, ``kvstrata.eviction``, ``kvstrata.admission``), e.g. in
their ``pyproject.toml``::

    [project.entry-points."kvstrata.tier"]
    my-tier = "my_package.tier:MyTier"

A name is never overwritten silently: registering a name that is taken by another
class (in code or through an entry point) raises :class:`DuplicateNameError`, which
names the registry, the name and both classes; registering the very same class again
is a no-op, and ``register(..., replace=True)`` replaces on purpose (an entry point of
that name is then ignored). Entry points are
read when a name is looked up that the registry does not know yet (and when its names
are listed), so a plugin costs nothing until it is used; a plugin that fails to import
is a :class:`~kvstrata.errors.ConfigError` naming its entry point and distribution.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from kvstrata.errors import ConfigError, KVStrataError, UnknownNameError

T = TypeVar("T")


class DuplicateNameError(KVStrataError, ValueError):
    """A registry name is already taken by another class (pass ``replace=True`` to replace it)."""


def _path_of(target: type | str) -> str:
    """``"module:QualName"`` of a class, or the lazy import path itself."""
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _same(a: type | str, b: type | str) -> bool:
    """Whether two targets name the same class (a class and its lazy path count as the same)."""
    if isinstance(a, str) or isinstance(b, str):
        return _path_of(a) == _path_of(b)
    return a is b


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f" of distribution {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value} (group {ep.group}{where})"


class Registry(Generic[T]):
    """A named collection of classes of one kind (``tier``, ``eviction``, ``admission``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, type[T] | str] = {}
        self._hints: dict[str, str] = {}
        self._origins: dict[str, str] = {}  # name -> entry point it came from
        self._replaced: set[str] = set()  # names replaced on purpose: their entry points are ignored
        self._entry_points_loaded = False

    @property
    def group(self) -> str:
        """The entry-point group third parties register in."""
        return f"kvstrata.{self.kind}"

    def register(
        self, name: str, target: type[T] | str | None = None, *, install_hint: str = "", replace: bool = False
    ) -> Callable[[type[T]], type[T]]:
        """Register ``target`` (a class or ``"module:attr"``) under ``name``.

        Usable as a decorator: ``@registry.register("lru")``. A name taken by another class
        raises :class:`DuplicateNameError` unless ``replace`` is true; the same class again
        is a no-op.
        """

        def deco(cls: type[T]) -> type[T]:
            self._add(name, cls, replace=replace)
            if install_hint:
                self._hints[name] = install_hint
            return cls

        if target is not None:
            self._add(name, target, replace=replace)
        if install_hint:
            self._hints[name] = install_hint
        return deco

    def unregister(self, name: str) -> None:
        """Forget ``name`` (an unknown name is ignored); an entry point of that name is read again
        on the next lookup that misses or listing of the names."""
        self._entries.pop(name, None)
        self._hints.pop(name, None)
        self._origins.pop(name, None)
        self._replaced.discard(name)
        self._entry_points_loaded = False

    def names(self) -> list[str]:
        if not self._entry_points_loaded:
            self._load_entry_points()
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        """Return the class registered as ``name``; import it lazily if needed."""
        if name not in self._entries:  # perhaps a plugin's: read the entry points again
            self._load_entry_points()
        target = self._entries.get(name)
        if target is None:
            known = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}", field=self.kind, value=name)
        if isinstance(target, str):
            target = self._import(name, target)
            self._entries[name] = target
        return target

    def _add(self, name: str, target: type[T] | str, *, replace: bool, origin: str = "") -> None:
        old = self._entries.get(name)
        if old is not None and not replace and not _same(old, target):
            was = f" (from {self._origins[name]})" if name in self._origins else ""
            new = f" (from {origin})" if origin else ""
            raise DuplicateNameError(
                f"{self.kind} registry: {name!r} is already registered to {_path_of(old)}{was}; "
                f"refusing to replace it with {_path_of(target)}{new} (register with replace=True to replace it)"
            )
        if old is not None and _same(old, target) and not replace:
            return  # the same class again (perhaps once as a lazy path): keep what is there
        if replace:
            self._replaced.add(name)
        self._entries[name] = target
        if origin:
            self._origins[name] = origin
        else:
            self._origins.pop(name, None)

    def _import(self, name: str, target: str) -> type[T]:
        module_name, _, attr = target.partition(":")
        origin = self._origins.get(name)
        try:
            module = importlib.import_module(module_name)
            cls: type[T] = getattr(module, attr)
            return cls
        except ImportError as exc:
            if origin is None:
                hint = self._hints.get(name, "")
                raise ConfigError(
                    f"{self.kind} {name!r} needs an optional dependency that is not installed ({exc})"
                    + (f"; install it with: {hint}" if hint else ""),
                    field=self.kind,
                    value=name,
                ) from exc
            raise self._plugin_error(name, origin, exc) from exc
        except Exception as exc:
            if origin is None:
                raise
            raise self._plugin_error(name, origin, exc) from exc

    def _plugin_error(self, name: str, origin: str, exc: BaseException) -> ConfigError:
        return ConfigError(
            f"{self.kind} {name!r} comes from the {origin}, which failed to import: {type(exc).__name__}: {exc}",
            field=self.kind,
            value=name,
        )

    def _load_entry_points(self) -> None:
        """Add every entry point of :attr:`group`; one that takes another class's name is refused."""
        for ep in entry_points(group=self.group):
            if ep.name in self._replaced:
                continue
            self._add(ep.name, ep.value, replace=False, origin=_origin(ep))
        self._entry_points_loaded = True
