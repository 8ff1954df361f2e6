"""One small generic registry per extension point (compressors, memories, communicators, policies).

Components register with a decorator; the package's submodules are imported on first lookup, so a
new algorithm is one new file and no edit elsewhere.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

if TYPE_CHECKING:
    from adacomp.policies.base import Policy

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps lower-case names to component classes.

    ``package`` is the dotted package whose submodules define the components; they are imported
    lazily the first time a name is looked up so importing adacomp stays cheap.
    """

    def __init__(self, kind: str, package: str):
        self.kind = kind
        self.package = package
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name != name.lower():
                raise ValueError(f"{self.kind} names are lower case, got {name!r}")
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice "
                                 f"({self._classes[name].__module__} and {cls.__module__})")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls
        return deco

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{self.package}.{mod.name}")

    def names(self) -> list[str]:
        self._load()
        return sorted(self._classes)

    def cls(self, name: str) -> type[T]:
        self._load()
        if not isinstance(name, str) or name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}")
        return self._classes[name]

    def get(self, name: str, **params: Any) -> T:
        """Build the component ``name`` with ``params`` (its ``__init__`` holds the defaults)."""
        return self.cls(name)(**params)

    def params(self, name: str) -> dict[str, inspect.Parameter]:
        """The keyword parameters of a component's constructor: the one source of defaults."""
        sig = inspect.signature(self.cls(name).__init__)
        return {k: p for k, p in sig.parameters.items()
                if k != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


# The extension points that live above the config layer are declared here, in the core, so that config
# can check a name against them without importing the engine (docs/architecture.md, "Layers"); their
# packages are imported by name on the first lookup, as for every registry.
policies: Registry["Policy"] = Registry("policy", "adacomp.policies")
outer_optimizers: Registry[Any] = Registry("outer optimizer", "adacomp.outer")
