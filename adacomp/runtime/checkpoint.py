"""Checkpoint sets you can trust across ranks, restarts and pre-emption.

Why per rank: error-feedback residuals, DGC velocities and sampling generators are local to each
rank, so every rank writes its own file. Why a *set*: files of different steps (a per-rank
save-on-signal handler, a disk that filled up on one rank) load without error and the replicas
diverge for good; so each file carries a header -- step, rank, world size, config hash, set id and
the SHA-256 of its payload -- and loading checks, collectively, that every rank reads the same
step of the same set before anything is applied.

File layout (format 2): ``ADACOMP-CHECKPOINT 2\\n``, one line of JSON (the header), then the
payload written by ``torch.save`` (tensors, numbers, strings, lists, dicts only: it is read with
``weights_only=True``, so opening a checkpoint never runs code from it).

Atomic writes: the bytes go to a temporary file in the *same* directory (``os.replace`` is atomic
only within one file system), are ``fsync``-ed, renamed over the target, and the directory is
``fsync``-ed. A set is published only after every rank wrote its file: rank 0 then writes the
set's manifest and flips ``latest``; until then ``latest`` names the previous set, which a failed
save (a full disk, a read-only directory, a rank that died) therefore never touches.

    from adacomp.runtime import checkpoint
    checkpoint.save_set("runs/ckpt", model, opt, step=step)          # collective, every N steps
    ...
    extra = checkpoint.load_set("runs/ckpt", model, opt)             # collective; None if no set yet
    start = extra["step"] if extra else 0

``load_set`` also resumes on another world size (:mod:`adacomp.checkpoint_reshard`).
:class:`Preemption` turns SIGTERM / SIGUSR1 into one consistent set and a clean exit.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import io
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, TypeAlias

import torch

from adacomp.backends import watchdog
from adacomp.checkpoint_reshard import owed, reshard
from adacomp.errors import AdacompError
from adacomp.preemption import PREEMPTED_EXIT_CODE, Preemption
from adacomp.runtime.per_rank import PerRank, load_per_rank, save_per_rank

FORMAT_VERSION = 2
MAGIC = b"ADACOMP-CHECKPOINT 2\n"
LATEST = "latest"
MANIFEST = "manifest.json"
PathLike: TypeAlias = "str | os.PathLike[str]"


class CheckpointError(AdacompError, ValueError):
    """A checkpoint file or set that cannot be used; the message names the file(s) and rank(s)."""


class CheckpointWriteError(AdacompError, OSError):
    """Writing a checkpoint failed (``errno`` kept: ENOSPC, EROFS, EACCES, ...); the previous one is intact."""


# --- single files -----------------------------------------------------------------------------
def rank_path(path: PathLike, rank: int) -> Path:
    """``dir/name.pt`` -> ``dir/name.rank{rank}.pt``: one file per rank (residuals are local)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.pt'}")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems cannot open a directory: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}."


_CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.EPERM: "operation not permitted"}


def _write_error(target: Path, exc: OSError) -> CheckpointWriteError:
    cause = _CAUSES.get(exc.errno or 0, exc.strerror or str(exc))
    code = errno.errorcode.get(exc.errno or 0, "?")
    err = CheckpointWriteError(exc.errno, f"could not write checkpoint {str(target)!r}: {cause} "
                               f"({code}: {exc.strerror or exc}); the previous checkpoint there, if any, "
                               "is untouched. Free space or choose a writable directory")
    err.filename = str(target)
    return err


def atomic_write(data: bytes, path: PathLike) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.
    Failures raise :class:`CheckpointWriteError` naming the path and the cause."""
    target = Path(path)
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent)
        tmp = Path(tmp_name)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise _write_error(target, exc) from exc
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    for stale in glob.glob(os.path.join(glob.escape(str(target.parent)), glob.escape(_temp_prefix(target)) + "*.tmp")):
        Path(stale).unlink(missing_ok=True)
    return target


def atomic_save(obj: Any, path: PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_write`)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write(buf.getvalue(), path)


def _config_hash(optimizer: Any, config_hash: str | None) -> str | None:
    """What the state means: the resolved config without ``train`` (epochs, output directory and
    the like may change between a run and its resumption; compressor, memory, communicator,
    fusion and policy may not)."""
    if config_hash is not None:
        return config_hash
    cfg: Any = getattr(optimizer, "config", None)
    if not hasattr(cfg, "to_dict"):
        return None
    d = cfg.to_dict()
    d.pop("train", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _backend(optimizer: Any, backend: Any) -> Any:
    if backend is not None:
        return backend
    if getattr(optimizer, "backend", None) is not None:
        return optimizer.backend
    from adacomp.runtime import context
    return context.current()


def state(model: torch.nn.Module | None, optimizer: Any, **extra: Any) -> dict[str, Any]:
    """The payload: model weights, ``optimizer.state_dict()`` and the caller's ``extra`` values."""
    return {"model": model.state_dict() if model is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": dict(extra)}


def encode(payload: dict[str, Any], header: dict[str, Any]) -> bytes:
    """Magic line, JSON header (with the payload's length and SHA-256), payload bytes."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    head = {"format": FORMAT_VERSION, **header, "payload_bytes": len(body),
            "sha256": hashlib.sha256(body).hexdigest()}
    return MAGIC + json.dumps(head, sort_keys=True).encode() + b"\n" + body


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(path)!r} {what}")


def read_header(path: PathLike) -> dict[str, Any]:
    """The header of a checkpoint file without reading its payload."""
    return _read(Path(path), payload=False)["header"]


def _read(p: Path, payload: bool = True) -> dict[str, Any]:
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist; expected a file written by "
                                "adacomp.runtime.checkpoint.save (one per rank: see rank_path) or a set directory "
                                "written by save_set")
    if p.is_dir():
        raise _bad(p, "is a directory; load a set directory with checkpoint.load_set")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(len(MAGIC))
            line = fh.readline(1 << 20)
            body = fh.read() if payload else b""
    except OSError as exc:
        raise _bad(p, f"cannot be read: {exc.strerror or exc}") from exc
    if len(magic) == 0:
        raise _bad(p, "is empty (0 bytes): the writer was probably killed or the disk was full; "
                      "load the previous set instead")
    if magic != MAGIC:
        hint = (" (a plain torch.save file: write checkpoints with adacomp.runtime.checkpoint.save)"
                if magic.startswith(b"PK") else "")
        raise _bad(p, f"is not an adacomp checkpoint of format {FORMAT_VERSION}: it does not start with "
                      f"{MAGIC!r}{hint}")
    try:
        header = json.loads(line.decode())
        if not isinstance(header, dict) or not line.endswith(b"\n"):
            raise ValueError("not a JSON object line")
    except ValueError as exc:
        raise _bad(p, f"has a damaged header ({exc}); the file is truncated or corrupted") from None
    if not payload:
        return {"header": header}
    want = int(header.get("payload_bytes", -1))
    if len(body) != want:
        raise _bad(p, f"is truncated or has trailing junk: its header announces {want} payload bytes, "
                      f"the file holds {len(body)}")
    digest = hashlib.sha256(body).hexdigest()
    if digest != header.get("sha256"):
        raise _bad(p, f"is corrupted: payload SHA-256 {digest[:16]}... differs from the header's "
                      f"{str(header.get('sha256'))[:16]}... (a flipped bit or a partial copy)")
    try:
        data = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling error means the same thing here
        raise _bad(p, f"has a payload torch.load refuses ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or not {"model", "optimizer", "extra"} <= set(data):
        raise _bad(p, "has a payload of the wrong kind (expected model / optimizer / extra)")
    return {**data, "header": header}


def read(path: PathLike) -> dict[str, Any]:
    """Read and verify one file: ``{"header", "model", "optimizer", "extra"}``."""
    return _read(Path(path))


def save(path: PathLike, model: torch.nn.Module | None, optimizer: Any, *, step: int | None = None,
         rank: int | None = None, world_size: int | None = None, config_hash: str | None = None,
         backend: Any = None, set_id: str | None = None, **extra: Any) -> Path:
    """Atomically write this rank's file (not collective; prefer :func:`save_set`). ``step`` goes
    into the header and into ``extra``; rank and world size default to the running job's."""
    if rank is None or world_size is None:
        b = _backend(optimizer, backend)
        rank = b.rank() if rank is None else rank
        world_size = b.size() if world_size is None else world_size
    if step is not None:
        extra["step"] = step
    header = {"step": step, "rank": rank, "world_size": world_size,
              "config_hash": _config_hash(optimizer, config_hash), "set": set_id}
    return atomic_write(encode(state(model, optimizer, **extra), header), path)


def _describe(infos: list[dict[str, Any]]) -> str:
    return "; ".join(f"rank {i['me']}: {i['path']} (step {i.get('step')}, written by rank {i.get('rank')} "
                     f"of {i.get('world_size')}, set {str(i.get('set'))[:8]})" for i in infos)


def _agree(backend: Any, mine: dict[str, Any]) -> None:
    """Every rank's verdict on its own file; raise the same error on every rank if any failed or
    the files are not one set (step, set id, config hash, world size)."""
    infos = backend.allgather_object(mine) if backend.size() > 1 else [mine]
    errors = [i for i in infos if i.get("error")]
    if errors:
        raise CheckpointError("cannot resume: " + "; ".join(f"rank {i['me']}: {i['error']}" for i in errors))
    for key, what in (("step", "different steps"), ("set", "files of different checkpoint sets"),
                      ("config_hash", "files written with different configs")):
        values = {i.get(key) for i in infos}
        if len(values) > 1:
            raise CheckpointError(f"ranks would resume from {what}, which makes the replicas diverge: "
                                  f"{_describe(infos)}. Expected one consistent set: write with "
                                  "checkpoint.save_set and load with checkpoint.load_set")


def _check_own(header: dict[str, Any], p: Path, rank: int, world: int) -> str | None:
    if header.get("world_size") not in (None, world):
        return (f"{p} was written by a job of {header.get('world_size')} ranks, this job has {world}; "
                "resume on another world size with checkpoint.load_set, which redistributes residuals")
    if header.get("rank") not in (None, rank):
        return (f"{p} is rank {header.get('rank')}'s file but rank {rank} loads it; each rank must load its "
                "own file (rank_path), or every rank would get one rank's error-feedback residuals")
    return None


def load(path: PathLike, model: torch.nn.Module | None, optimizer: Any, *, backend: Any = None,
         config_hash: str | None = None, collective: bool = True) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` from this rank's file; returns the ``extra`` values.

    Collective (every rank calls it) unless ``collective=False``: before anything is applied,
    every rank checks its file (checksum, rank, world size, config hash) and the ranks compare
    step and set, so a mix fails on every rank with the files, ranks and steps named."""
    b = _backend(optimizer, backend)
    rank, world = b.rank(), b.size()
    p = Path(path)
    mine: dict[str, Any] = {"me": rank, "path": str(p)}
    data = None
    try:
        data = read(p)
        h = data["header"]
        mine.update(step=h.get("step"), set=h.get("set"), rank=h.get("rank"), world_size=h.get("world_size"),
                    config_hash=h.get("config_hash"))
        mine["error"] = _check_own(h, p, rank, world) or _config_mismatch(h, optimizer, config_hash, p)
    except FileNotFoundError as exc:
        mine["error"] = _world_changed(p, rank, world) or str(exc)
    except CheckpointError as exc:
        mine["error"] = str(exc)
    if collective:
        _agree(b, mine)
    elif mine.get("error"):
        raise CheckpointError(mine["error"])
    assert data is not None
    _apply(data, model, optimizer)
    return dict(data["extra"])


def _world_changed(p: Path, rank: int, world: int) -> str | None:
    """This rank's file is missing: if rank 0's file of the same name says another world size wrote
    it, say that (a 1-rank checkpoint resumed on 2 ranks), not merely "does not exist"."""
    suffix = f".rank{rank}{p.suffix}"
    if not p.name.endswith(suffix):
        return None
    first = p.with_name(p.name[:-len(suffix)] + f".rank0{p.suffix}")
    try:
        old = read_header(first).get("world_size")
    except (OSError, CheckpointError):
        return None
    if old in (None, world):
        return None
    return (f"{p} does not exist: this checkpoint was written by a {old}-rank job ({first} says so) and this job "
            f"has {world} ranks. The world size changed: per-rank files cannot be matched one to one; save with "
            "adacomp.checkpoint.save_set and resume with load_set, which applies the world-size rule "
            "(docs/reliability.md), or keep the compression state in adacomp.checkpoint.PerRank")


def _config_mismatch(header: dict[str, Any], optimizer: Any, config_hash: str | None, p: Path) -> str | None:
    want = _config_hash(optimizer, config_hash)
    got = header.get("config_hash")
    if want is not None and got is not None and want != got:
        return (f"{p} was written with config hash {got}, this optimizer's config hashes to {want}; "
                "build the optimizer with the config the checkpoint was written with")
    return None


def _replicas_mean(models: list[Any], base: Any) -> Any:
    """The model a new rank starts from on another world size: the old ranks' weights are equal (a
    step's round averaged them), then ``base``'s; inside a local-steps window they differ, and every
    new rank starts from their mean, what the window's pending synchronisation averages (old rank
    ``s mod W_old``'s alone would drop the other replicas' local progress). Non-float entries (step
    counters, BatchNorm's ``num_batches_tracked``) come from ``base``."""
    if base is None or all(m.keys() == base.keys() and all(torch.equal(m[k], base[k]) for k in base)
                           for m in models):
        return base
    out = {}
    for k, v in base.items():
        floats = isinstance(v, torch.Tensor) and v.is_floating_point()
        out[k] = torch.stack([m[k].to(torch.float64) for m in models]).mean(0).to(v.dtype) if floats else v
    return out


def _apply(data: dict[str, Any], model: torch.nn.Module | None, optimizer: Any) -> None:
    if model is not None:
        model.load_state_dict(data["model"])
    if optimizer is not None:
        optimizer.load_state_dict(data["optimizer"])


# --- sets -------------------------------------------------------------------------------------
def _set_dir(step: int, set_id: str) -> str:
    return f"step-{step:010d}-{set_id[:8]}"


def latest(directory: PathLike) -> Path | None:
    """The newest complete set in ``directory`` (what ``latest`` names), or None."""
    d = Path(directory)
    try:
        name = (d / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(d / LATEST)!r}: {exc.strerror or exc}") from exc
    if not name or "/" in name or not (d / name / MANIFEST).exists():
        raise CheckpointError(f"{str(d / LATEST)!r} names {name!r}, which is not a complete set in {str(d)!r}; "
                              "expected the name of a step-* directory holding manifest.json")
    return d / name


def save_set(directory: PathLike, model: torch.nn.Module | None, optimizer: Any, *, step: int,
             backend: Any = None, config_hash: str | None = None, keep: int = 2, **extra: Any) -> Path:
    """Collective: every rank writes its file of a new set ``directory/step-<step>-<id>/``; once all
    succeeded, rank 0 writes the manifest and points ``latest`` at it, then removes all but the
    ``keep`` newest sets. If any rank fails, every rank raises one error naming the ranks, files and
    causes, the partial set is removed, and ``latest`` still names the previous set. A rank that dies
    or stops meanwhile is named (the watchdog guards the set's collectives, as it guards a step's)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the set just written), got {keep}")
    b = _backend(optimizer, backend)
    with watchdog.guard(b):
        return _save_set(b, Path(directory), model, optimizer, step, config_hash, keep, extra)


def _save_set(b: Any, d: Path, model: torch.nn.Module | None, optimizer: Any, step: int, config_hash: str | None,
              keep: int, extra: dict[str, Any]) -> Path:
    rank, world = b.rank(), b.size()
    set_id = uuid.uuid4().hex if rank == 0 else None
    if world > 1:
        set_id = b.broadcast_object(set_id, 0)
    assert set_id is not None  # rank 0's id, broadcast to every rank
    sdir = d / _set_dir(step, set_id)
    path = sdir / f"rank{rank}.pt"
    chash = _config_hash(optimizer, config_hash)
    mine: dict[str, Any] = {"rank": rank, "path": str(path)}
    try:
        _check_extra(extra)
        data = encode(state(model, optimizer, **{**extra, "step": step}),
                      {"step": step, "rank": rank, "world_size": world, "config_hash": chash, "set": set_id})
        atomic_write(data, path)
        mine.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    except CheckpointWriteError as exc:
        mine["error"] = str(exc)
    results = b.allgather_object(mine) if world > 1 else [mine]
    failed = [r for r in results if r.get("error")]
    if not failed and rank == 0:
        manifest = {"format": FORMAT_VERSION, "step": step, "set": set_id, "world_size": world,
                    "config_hash": chash, "files": {str(r["rank"]): {"name": Path(r["path"]).name,
                                                                      "sha256": r["sha256"], "bytes": r["bytes"]}
                                                     for r in results}}
        try:
            atomic_write(json.dumps(manifest, indent=1, sort_keys=True).encode(), sdir / MANIFEST)
            atomic_write(f"{sdir.name}\n".encode(), d / LATEST)
        except CheckpointWriteError as exc:
            failed = [{"rank": 0, "path": str(sdir / MANIFEST), "error": str(exc)}]
    if world > 1:
        failed = b.broadcast_object(failed, 0)
    if failed:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError:  # e.g. the directory is a file: the error below says what failed
            pass
        if rank == 0:
            _remove_unless_latest(d, sdir)
        prev = _safe_latest(d)
        raise CheckpointWriteError(
            errno.EIO, f"checkpoint set for step {step} in {str(d)!r} was not written: "
            + "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed)
            + f". {'The previous set ' + prev.name + ' is still the latest' if prev else 'No earlier set exists'}")
    if rank == 0:
        _prune(d, keep)
    return sdir


def _safe_latest(d: Path) -> Path | None:
    try:
        return latest(d)
    except CheckpointError:
        return None


def _remove_unless_latest(d: Path, sdir: Path) -> None:
    """A set whose save failed goes, whatever it holds (its ranks removed their files; a manifest
    may be there when only ``latest`` could not be written), unless ``latest`` names it."""
    current = _safe_latest(d)
    if sdir.is_dir() and (current is None or current.name != sdir.name):
        shutil.rmtree(sdir, ignore_errors=True)


def _complete(sdir: Path) -> bool:
    """A manifest and every member file it lists."""
    try:
        files = json.loads((sdir / MANIFEST).read_text())["files"]
        return all((sdir / f["name"]).is_file() for f in files.values())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _check_extra(extra: dict[str, Any]) -> None:
    """Every extra value must load back under ``torch.load(weights_only=True)`` (what :func:`load_set`
    reads with): a numpy scalar or a Path would be written and then refused at resume, after pruning
    had removed the sets that could load. Small values: each is round-tripped alone."""
    for key, value in extra.items():
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal means the same thing here
            raise CheckpointWriteError(errno.EINVAL, f"extra value {key}={type(value).__name__} would not load back "
                                       f"(torch.load(weights_only=True): {type(exc).__name__}); pass plain Python "
                                       "numbers, strings, lists, dicts or tensors (e.g. float(loss))") from None


def _prune(d: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest complete sets (never the one ``latest`` names)."""
    current = _safe_latest(d)
    sets = sorted(p for p in d.glob("step-*") if _complete(p))
    for old in sets[:-keep] if len(sets) > keep else []:
        if current is None or old.name != current.name:
            shutil.rmtree(old, ignore_errors=True)


def load_set(directory: PathLike, model: torch.nn.Module | None, optimizer: Any, *, backend: Any = None,
             config_hash: str | None = None) -> dict[str, Any] | None:
    """Collective: restore the set ``latest`` names (see :func:`_load_set`); a rank that dies or stops
    meanwhile is named."""
    b = _backend(optimizer, backend)
    with watchdog.guard(b):
        return _load_set(b, Path(directory), model, optimizer, config_hash)


def _load_set(b: Any, d: Path, model: torch.nn.Module | None, optimizer: Any,
              config_hash: str | None) -> dict[str, Any] | None:
    """Collective: restore the set ``latest`` names (chosen by rank 0, so every rank agrees);
    returns its ``extra`` values (with ``step``), or None on every rank when there is no set yet.

    On the world size it was written with, rank r reads ``rank{r}.pt``; on another one, every rank
    reads all files and :func:`~adacomp.checkpoint_reshard.reshard` redistributes the per-rank
    error-feedback state (the rule keeps ``(1/W) * sum of residuals``). Every file is verified
    (checksum, header against the manifest) and the ranks compare what they loaded before
    anything is applied."""
    rank, world = b.rank(), b.size()
    choice: dict[str, Any] = {}
    if rank == 0:
        try:
            found = latest(d)
            choice = {"name": found.name if found else None}
        except CheckpointError as exc:
            choice = {"error": str(exc)}
    if world > 1:
        choice = b.broadcast_object(choice, 0)
    if choice.get("error"):
        raise CheckpointError(choice["error"])
    if choice.get("name") is None:
        return None
    sdir = d / choice["name"]
    mine: dict[str, Any] = {"me": rank, "path": str(sdir)}
    data: dict[str, Any] | None = None
    try:
        manifest = _read_manifest(sdir)
        w_old = int(manifest["world_size"])
        ranks = [rank] if w_old == world else list(range(w_old))
        files = [_read_member(sdir, manifest, r) for r in ranks]
        head = files[0]["header"]
        mine.update(step=head.get("step"), set=head.get("set"), rank=head.get("rank"),
                    world_size=head.get("world_size"), config_hash=head.get("config_hash"),
                    path=str(sdir / manifest["files"][str(ranks[0])]["name"]))
        mine["error"] = _config_mismatch(head, optimizer, config_hash, sdir)
        if w_old == world:
            data = files[0]
        else:
            base = files[rank % w_old]
            opt_state = (reshard([f["optimizer"] for f in files], world, rank, optimizer)
                         if base["optimizer"] is not None else None)
            data = {**base, "optimizer": opt_state, "model": _replicas_mean([f["model"] for f in files], base["model"])}
            mine["step"], mine["set"] = base["header"].get("step"), base["header"].get("set")
    except (CheckpointError, FileNotFoundError, KeyError, ValueError) as exc:
        mine["error"] = str(exc) if not isinstance(exc, KeyError) else f"{sdir}: manifest lacks {exc}"
    _agree(b, mine)
    assert data is not None
    _apply(data, model, optimizer)
    return dict(data["extra"])


def _read_manifest(sdir: Path) -> dict[str, Any]:
    p = sdir / MANIFEST
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(sdir)!r} has no {MANIFEST}: the set is incomplete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(p)!r} cannot be read as JSON ({exc}); the set is damaged") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_VERSION or "files" not in m:
        raise CheckpointError(f"{str(p)!r} is not a format-{FORMAT_VERSION} manifest")
    return m


def _read_member(sdir: Path, manifest: dict[str, Any], r: int) -> dict[str, Any]:
    entry = manifest["files"].get(str(r))
    if entry is None:
        raise CheckpointError(f"{sdir / MANIFEST} lists no file for rank {r} (ranks {sorted(manifest['files'])})")
    p = sdir / entry["name"]
    data = read(p)
    h = data["header"]
    for key in ("step", "set", "world_size"):
        if h.get(key) != manifest.get(key):
            raise CheckpointError(f"{p} has {key} {h.get(key)!r} but its set's manifest says "
                                  f"{manifest.get(key)!r}: a file from another set was copied in")
    if h.get("rank") != r:
        raise CheckpointError(f"{p} holds rank {h.get('rank')}'s state but the manifest lists it for rank {r}")
    return data


__all__ = ["FORMAT_VERSION", "PREEMPTED_EXIT_CODE", "CheckpointError", "CheckpointWriteError", "PerRank", "Preemption",
           "atomic_save", "atomic_write", "encode", "latest", "load", "load_per_rank", "load_set", "owed", "rank_path",
           "read", "read_header", "reshard", "save", "save_per_rank", "save_set", "state"]
