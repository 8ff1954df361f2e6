"""Adaptive policies: static, flexible, moo, lgreco, bytecomp."""
from adacomp.policies.base import Policy, get, names, register, registry

__all__ = ["Policy", "get", "names", "register", "registry"]
