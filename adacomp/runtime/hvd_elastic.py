"""Horovod's ``hvd.elastic`` (``run``, ``TorchState``, ``ElasticSampler``) for ``import adacomp as hvd``.

Semantics follow Horovod 0.28.1 (``horovod/common/elastic.py``, ``horovod/torch/elastic``): a state
object keeps a committed copy of the model, optimizer, sampler and plain attributes; ``run`` syncs it
from rank 0, calls the training function, and on a recoverable failure restores the last commit,
resets the transport and calls again.

Under the torch backend the launcher is ``torchrun --max-restarts N``: a failed worker makes torchrun
restart *every* worker as a fresh process, so an in-memory commit would be lost. Hence ``commit()``
also writes the committed state (each rank its own file, atomically) to ``$ADACOMP_ELASTIC_DIR`` (default
``$TMPDIR/adacomp-elastic-<TORCHELASTIC_RUN_ID>``), and ``run`` loads it on a restart attempt, so the
model, the counters and the sampler's position all continue from the last commit. Under the Horovod
backend (``horovodrun``, elastic mode) ``run`` delegates to Horovod's own driver loop.
"""
from __future__ import annotations

import copy
import functools
import math
import os
import queue
import random
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from adacomp.errors import CommunicationError
from adacomp.runtime import context
from adacomp.runtime.hvd_api import allgather_object, init, rank, shutdown, size
from adacomp.runtime.sync import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "State", "ObjectState", "TorchState", "run", "state_dir"]

DIR_ENV = "ADACOMP_ELASTIC_DIR"


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: every rank leaves the training function to re-sync (Horovod's)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def _on_horovod() -> bool:
    return getattr(context.current(), "name", "") == "horovod"


def state_dir() -> Path | None:
    """Where commits persist across torchrun restarts: one folder per job (torchrun's run id), so two
    jobs never read each other's commits. None outside torchrun unless ``ADACOMP_ELASTIC_DIR`` is set
    (then there is no restart to survive, and commits stay in memory as in Horovod)."""
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    return Path(tempfile.gettempdir()) / f"adacomp-elastic-{run_id}"


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class State:
    """Committed state plus reset callbacks; the host-update protocol Horovod's driver calls into
    (``on_hosts_updated``, ``on_reset``), so the same object works under ``horovodrun`` elastic."""

    def __init__(self) -> None:
        self._host_messages: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Callbacks run after every reset (e.g. rescale the learning rate to the new world size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: Any) -> None:
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (in memory and, under torchrun, to the job's file), then check for host
        updates. The check is a broadcast from rank 0 after its write, so once ``commit()`` returns on
        any rank the commit is on disk: a rank that dies right after cannot leave an older one."""
        self.save()
        self._commits += 1
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when Horovod's driver announced a host change.
        torchrun announces none (it restarts all workers instead), so there it only agrees with rank 0."""
        prev = last = self._last_updated_timestamp
        update: Any = 0
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update = update | res
        # all ranks' view, rank 0's taken (Horovod broadcasts it): an allgather, so commit() returns on
        # a rank only once every rank has written its commit
        prev, self._last_updated_timestamp, update = allgather_object((prev, last, update))[0]
        if self._last_updated_timestamp > prev:
            removed = int(update) == 1  # Horovod's HostUpdateResult.removed
            if _on_horovod():
                from horovod.common.exceptions import HostsUpdatedInterrupt as HvdInterrupt
                raise HvdInterrupt(removed)
            raise HostsUpdatedInterrupt(removed)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Hook for subclasses: rebuild what depends on the world (before the sync)."""

    # persistence across torchrun restarts
    def _payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_payload(self, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def _files(self) -> dict[int, Path]:
        """This rank's committed files by commit number (the last two are kept)."""
        d = state_dir()
        if d is None or not d.is_dir():
            return {}
        found = {}
        for f in d.glob(f"rank{rank()}-commit*.pt"):
            try:
                found[int(f.stem.rsplit("commit", 1)[1])] = f
            except ValueError:
                continue
        return found

    def _persist(self) -> None:
        """Every rank writes its own file: a DistributedOptimizer's compression state (residuals) is
        per rank. The previous commit is kept until the next one, so a rank killed between its write
        and the others' can still resume from a commit every rank holds."""
        d = state_dir()
        if d is None:
            return
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{rank()}-commit{self._commits}.pt"
        tmp = d / f".rank{rank()}-tmp{os.getpid()}"
        with open(tmp, "wb") as out:
            torch.save({"commits": self._commits, "world": size(), **self._payload()}, out)
        os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous commits
        for k, f in self._files().items():
            if k < self._commits - 1:
                f.unlink(missing_ok=True)

    def _resume(self) -> bool:
        """On a torchrun restart attempt load the newest commit that every rank holds (a collective);
        ``sync()`` then makes rank 0's shared state everyone's. On the first attempt files left by an
        earlier job with the same run id are removed instead."""
        if state_dir() is None:
            return False
        files = self._files()
        if _restart_count() == 0:
            for f in files.values():
                f.unlink(missing_ok=True)
            files = {}
        held = allgather_object(sorted(files))
        common = set(held[0]).intersection(*map(set, held[1:]))
        if not common:
            return False
        payload = torch.load(files[max(common)], weights_only=False)
        if int(payload.pop("world")) != size():
            raise RuntimeError(f"elastic state in {state_dir()} was committed by a world of a different size; "
                               f"adacomp resumes torchrun restarts at the same world size only")
        self._commits = int(payload.pop("commits"))
        self._load_payload(payload)
        self.save()
        return True


class ObjectState(State):
    """Plain picklable attributes (the keyword arguments), committed by value and synced from rank 0."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            object.__setattr__(self, k, copy.deepcopy(v))

    def _payload(self) -> dict[str, Any]:
        return {"scalars": self._saved_state}

    def _load_payload(self, payload: dict[str, Any]) -> None:
        self._saved_state = dict(payload["scalars"])
        self._set_attrs()


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Partitions the epoch's *remaining* indices across the current world, so after a reset or a
    restart the epoch continues without repeating the samples already processed. Horovod 0.28.1
    counts processed samples (``record_batch``); ``record_indices`` (older Horovod) records exact
    indices for loaders that do not consume the partition in order. Call ``set_epoch`` at the *end*
    of an epoch: it clears the record."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank processed ``batch_size`` samples (Horovod's rule: the world's batch is consumed)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        """This rank processed exactly ``indices``; the ranks' records are merged at sync and commit."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self) -> None:
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        rest = order[self.processed_num:]
        if self.processed_indices:
            rest = [i for i in rest if i not in self.processed_indices]
        self.remaining_indices = rest
        self.num_samples = int(math.ceil(len(rest) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        idx = self.remaining_indices[:]
        idx += idx[:self.total_size - len(idx)]  # pad so every rank gets as many (as Horovod)
        return iter(idx[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """Commit / restore / sync for one object that has ``state_dict`` / ``load_state_dict``."""

    def __init__(self, value: Any):
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        """Horovod's rule (``broadcast_optimizer_state``): the torch optimizer's state from rank 0; a
        DistributedOptimizer's compression state stays per rank."""
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def merge(self) -> None:
        """Union every rank's recorded indices (a collective: called at the same point on all ranks)."""
        merged = set().union(*(set(s) for s in allgather_object(sorted(self.value.processed_indices))))
        if merged != self.value.processed_indices:
            self.value.processed_indices = merged
            self.value.reset()

    def sync(self) -> None:
        self.merge()
        super().sync()


def _handler(value: Any) -> _Handler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    return None


class TorchState(ObjectState):
    """Horovod's ``TorchState(model=, optimizer=, **kwargs)``: models, optimizers and ``ElasticSampler``
    s among the keywords are committed through their ``state_dict``, everything else by value; all
    are attributes. Assigning a new model / optimizer / sampler commits it (as Horovod)."""

    _handlers: dict[str, _Handler]

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for k, v in kwargs.items():
            h = _handler(v)
            if h is None:
                plain[k] = v
            else:
                handlers[k] = h
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        object.__setattr__(self, name, value)

    def commit(self) -> None:
        for h in self._handlers.values():
            if isinstance(h, _SamplerHandler):
                h.merge()
        super().commit()

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def _payload(self) -> dict[str, Any]:
        return {"handlers": {k: h.saved for k, h in self._handlers.items()}, **super()._payload()}

    def _load_payload(self, payload: dict[str, Any]) -> None:
        for k, saved in payload["handlers"].items():
            if k in self._handlers:
                self._handlers[k].value.load_state_dict(saved)
        super()._load_payload(payload)


def _reset() -> None:
    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` runs after ``state.sync()``; on a host
    update every rank resets and calls it again. Under torchrun a restart attempt first loads the last
    commit from the job's file. A failed collective (``HorovodInternalError``) restores the last
    commit; under Horovod the driver then re-forms the ring and we retry, under torchrun the peer is
    gone and the agent restarts every worker, so we re-raise and let the restart resume from the file."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if _on_horovod():
            from horovod.common.elastic import run_fn
            return run_fn(func, _reset)(state, *args, **kwargs)
        state._resume()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            except CommunicationError:
                state.restore()
                raise
            _reset()
            state.on_reset()
    return wrapper
