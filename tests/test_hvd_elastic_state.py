"""``hvd.elastic`` semantics that need no restart, against real ``horovod.torch.elastic`` where it is
installed (same operations on both, results equal): TorchState commit / restore / assignment /
reset callbacks, ElasticSampler partitioning, ``record_batch``, ``set_epoch``, state_dict round trip.
The restart test is tests/test_hvd_elastic.py. Single process, no launcher, so these stay in the
quick set."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import adacomp as hvd
from adacomp.runtime import hvd_elastic

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None


@pytest.fixture(autouse=True, scope="module")
def _shut_down_after() -> Any:
    """The one-process transports started here must not leak into later tests of the same run."""
    yield
    hvd.shutdown()
    if HAVE_HOROVOD:
        import horovod.torch as hhvd
        if hhvd.is_initialized():
            hhvd.shutdown()


def _horovod() -> Any:
    if not HAVE_HOROVOD:
        return None
    import horovod.torch as hhvd
    hhvd.init()
    return hhvd


def _implementations() -> list[Any]:
    hvd.init()
    impls = [hvd]
    h = _horovod()
    if h is not None:
        impls.append(h)
    return impls


def _round_trip(impl: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = impl.elastic.TorchState(model=model, optimizer=opt, epoch=1, batch=5)
    calls: list[int] = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    state.batch = 6
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    state.epoch, state.batch = 2, 0
    state.restore()
    restored = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    state.sync()
    state.on_reset()
    return {"epoch": state.epoch, "batch": state.batch, "params_equal_commit":
            all(torch.equal(a, b) for a, b in zip(committed, restored)),
            "params": restored, "momentum": momentum, "callbacks": len(calls)}


def test_torch_state_commit_restore_matches_horovod() -> None:
    results = [_round_trip(impl) for impl in _implementations()]
    ours = results[0]
    assert ours["epoch"] == 1 and ours["batch"] == 6 and ours["params_equal_commit"] and ours["callbacks"] == 1
    for theirs in results[1:]:
        assert {k: ours[k] for k in ("epoch", "batch", "params_equal_commit", "callbacks")} == \
               {k: theirs[k] for k in ("epoch", "batch", "params_equal_commit", "callbacks")}
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"]))
        assert all(torch.equal(a, b) for a, b in zip(ours["momentum"], theirs["momentum"]))


def test_assigning_a_new_model_commits_it() -> None:
    """Horovod: ``state.model = other`` replaces the tracked model and saves it."""
    for impl in _implementations():
        state = impl.elastic.TorchState(model=torch.nn.Linear(2, 2), optimizer=None)
        other = torch.nn.Linear(2, 2)
        state.model = other
        before = other.weight.detach().clone()
        with torch.no_grad():
            other.weight.add_(1.0)
        state.restore()
        assert state.model is other and torch.equal(other.weight, before), impl.__name__


def _world(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    """Partitioning depends on rank() / size() only; set them as a world of ``size`` would."""
    monkeypatch.setattr(hvd_elastic, "rank", lambda: rank)
    monkeypatch.setattr(hvd_elastic, "size", lambda: size)
    if HAVE_HOROVOD:
        import horovod.torch.elastic.sampler as hs
        monkeypatch.setattr(hs, "rank", lambda: rank)
        monkeypatch.setattr(hs, "size", lambda: size)


def _sampler_trace(cls: Any, shuffle: bool) -> list[Any]:
    data = list(range(23))
    s = cls(data, shuffle=shuffle, seed=3)
    trace: list[Any] = [list(s), len(s)]
    for b in range(2):
        s.record_batch(b, 2)
    s.reset()
    trace += [list(s), len(s), dict(epoch=s.state_dict()["epoch"], processed_num=s.state_dict()["processed_num"])]
    other = cls(data, shuffle=shuffle, seed=3)
    other.load_state_dict(s.state_dict())
    trace += [list(other), len(other)]
    s.set_epoch(1)
    trace += [list(s), len(s)]
    return trace


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2), (2, 3)])
def test_sampler_matches_horovod(monkeypatch: pytest.MonkeyPatch, shuffle: bool, rank: int, size: int) -> None:
    _world(monkeypatch, rank, size)
    ours = _sampler_trace(hvd.elastic.ElasticSampler, shuffle)
    # every rank's partition of the remaining indices, together, covers them (padding repeats a few)
    if not HAVE_HOROVOD:
        pytest.skip("horovod not installed: compared with adacomp's own expectations only")
    import horovod.torch.elastic as he
    assert ours == _sampler_trace(he.ElasticSampler, shuffle)


def test_sampler_partitions_remaining_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Across a world of 3 after 4 world-batches of 1: the ranks' parts are disjoint and together
    are exactly the epoch's unprocessed indices (24 samples: no padding)."""
    parts = []
    for r in range(3):
        _world(monkeypatch, r, 3)
        s = hvd.elastic.ElasticSampler(list(range(24)), shuffle=True, seed=1)
        first = list(s)[:4]
        for b in range(4):
            s.record_batch(b, 1)
        s.reset()
        parts.append((first, list(s)))
    done = [i for first, _ in parts for i in first]
    rest = [i for _, part in parts for i in part]
    assert len(set(rest)) == len(rest) == 12 and not set(rest) & set(done) and set(rest) | set(done) == set(range(24))


def test_record_indices_excludes_exactly_those() -> None:
    hvd.init()
    s = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    s.record_indices([1, 3, 5])
    s.reset()
    assert list(s) == [0, 2, 4, 6, 7, 8, 9]
    restored = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    restored.load_state_dict(s.state_dict())
    assert list(restored) == list(s)
    s.set_epoch(1)
    assert list(s) == list(range(10))


def test_state_dir_is_per_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delenv(hvd_elastic.DIR_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert hvd_elastic.state_dir() is None  # no launcher that restarts: commits stay in memory
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert hvd_elastic.state_dir().name == "adacomp-elastic-job7"  # type: ignore[union-attr]
    monkeypatch.setenv(hvd_elastic.DIR_ENV, str(tmp_path))
    assert hvd_elastic.state_dir() == tmp_path
