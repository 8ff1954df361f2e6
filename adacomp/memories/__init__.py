"""Error-feedback memories. ``get(name, **params)`` builds one; ``names()`` lists them."""
from adacomp.memories.base import Memory, get, names, register, registry

__all__ = ["Memory", "get", "names", "register", "registry"]
