"""tests/_dist.py's ranks fork from a server that imported torch once: each must still see what a
spawned rank saw, the caller's environment of the moment, and none of the caller's module state."""
from __future__ import annotations

import os

import pytest

from tests._dist import run_workers

MARK = {"set": False}  # changed in the caller below: a rank must not see the change


def _what_a_rank_sees() -> tuple[str | None, str | None, str | None, bool, int]:
    import torch
    return (os.environ.get("ADACOMP_TEST_MARK"), os.environ.get("ADACOMP_TEST_GONE"), os.environ.get("RANK"),
            MARK["set"], torch.get_num_threads())


def test_a_rank_sees_the_callers_environment_now_and_not_its_module_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADACOMP_TEST_GONE", "1")
    run_workers(_what_a_rank_sees, 1)  # the server may start here, with this environment
    monkeypatch.delenv("ADACOMP_TEST_GONE")
    monkeypatch.setenv("ADACOMP_TEST_MARK", "now")
    monkeypatch.setitem(MARK, "set", True)
    got = run_workers(_what_a_rank_sees, 2)
    assert got == [("now", None, "0", False, 1), ("now", None, "1", False, 1)]
    assert run_workers(_what_a_rank_sees, 1, env={"ADACOMP_TEST_MARK": "given"})[0][0] == "given"
