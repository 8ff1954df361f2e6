"""Communicators: how a bucket's payloads reach the other ranks."""
from adacomp.communicators.base import CommEnv, Communicator, Entry, fitting, get, names, register, registry

__all__ = ["CommEnv", "Communicator", "Entry", "fitting", "get", "names", "register", "registry"]
