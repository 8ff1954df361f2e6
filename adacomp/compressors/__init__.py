"""Gradient compressors. ``get(name, **params)`` builds one; ``names()`` lists them."""
from adacomp.compressors.base import Compressor, Payload, get, names, register, registry

__all__ = ["Compressor", "Payload", "get", "names", "register", "registry"]
