"""Horovod's process sets for the module API (``import adacomp as hvd``, issue 31):
``add_process_set`` / ``remove_process_set``, mapped onto sub-groups of the running backend
(torch: ``dist.new_group``; MPI: ``Comm.Split``; :meth:`adacomp.backends.base.Backend.subgroup`).

Semantics follow Horovod 0.28.1 (https://horovod.readthedocs.io/en/stable/process_set_include.html):
every rank adds a set collectively with the same ranks, in the same order; a set whose ranks equal
an existing set's (the global set included) is a ValueError; ids count up from 1 and removed ids
are reused, the first removed first; ``remove_process_set`` is collective too and answers False for the global set
or a set that is not added. Horovod needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or
``hvd.init(process_sets="dynamic")``) before ``add_process_set``; adacomp always allows it, and
``init(process_sets=[...])`` adds a list of sets at start-up, as Horovod's static sets.

The :class:`~adacomp.engine.hvd_keywords.ProcessSet` object itself is engine code, so that
``DistributedOptimizer`` can take ``process_set=`` without reaching up into the runtime.
"""
from __future__ import annotations

from typing import Any, Sequence

from adacomp.backends.base import Backend
from adacomp.engine.hvd_keywords import ProcessSet, global_process_set
from adacomp.runtime import context

# Sets added on the running backend: id -> set. Dropped when the backend changes (shutdown / init).
_SETS: dict[int, ProcessSet] = {}
_OWNER: list[Backend | None] = [None]
_FREED: list[int] = []  # ids of removed sets, reused first-freed first (as Horovod's table does)


def _table() -> dict[int, ProcessSet]:
    be = context.current()
    if _OWNER[0] is not be:  # a new init(): the old sets died with their backend
        for ps in _SETS.values():
            ps._invalidate()
        _SETS.clear()
        _FREED.clear()
        _OWNER[0] = be
    return _SETS


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Add a process set (a :class:`ProcessSet` or a list of global ranks) and return it, ready
    for ``process_set=``. Collective: every rank calls it with the same ranks."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    table = _table()
    be = context.current()
    ranks = list(ps.ranks or [])
    world = be.size()
    if not ranks or any(not 0 <= r < world for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"a process set needs distinct ranks in [0, {world}), got {ranks}")
    if ps.process_set_id is not None or ranks == list(range(world)) or any(
            other.ranks == ranks for other in table.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    sub = be.subgroup(ranks)
    ps.process_set_id = _FREED.pop(0) if _FREED else max([*table, 0]) + 1
    ps._backend = sub
    table[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove ``process_set`` (collective); False for the global set or a set not added."""
    table = _table()
    pid = getattr(process_set, "process_set_id", None)
    if pid is None or pid == 0 or process_set is global_process_set or table.get(pid) is not process_set:
        return False
    del table[pid]
    _FREED.append(pid)
    sub = process_set._backend
    process_set._invalidate()
    if sub is not None:
        sub.shutdown()
    return True


def init(backend: str = "auto", config: Any = None, timeout_s: float | None = None,
         process_sets: Any = None) -> Backend:
    """``adacomp.init`` plus Horovod's ``process_sets=``: a list of :class:`ProcessSet` added now
    (static sets), or ``"dynamic"`` (accepted; adacomp always allows adding sets later)."""
    be = context.init(backend, config, timeout_s)
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        return be
    for ps in process_sets:
        if not (isinstance(ps, ProcessSet) and ps.process_set_id is not None
                and _table().get(ps.process_set_id) is ps):
            add_process_set(ps)
    return be


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "init", "remove_process_set"]
