"""Checkpoints that never lose data: one file, written to a temporary name beside it, fsynced, renamed.

The file is a ``torch.save`` zip (loadable with ``weights_only=True``)::

    {"format": "offload-checkpoint", "version": 1,
     "model": {name: fp32 tensor},            # like model.state_dict(): model.load_state_dict(ck["model"])
     "optimizer": AdamW.state_dict(), "scaler": {...} | None,
     "rng": {"torch": ..., "cuda": [...], "python": ..., "numpy": ...}, "extra": ... | None}

Weights and AdamW state are written straight from the host arena: each tensor handed to ``torch.save``
aliases exactly its bytes of the arena, so saving copies nothing and writes nothing else of the arena.

Data parallel (issue 20): the file is the same, whatever the number of ranks. ``save`` is collective (every
rank calls it; each gathers the other ranks' shards of masters, m and v, and rank 0 alone writes), and
``load`` on any number of ranks (or one process) reads the whole file and keeps its shard.
"""

from __future__ import annotations

import glob
import os
import random
import uuid
from typing import TYPE_CHECKING, Any

import torch

from .errors import CheckpointError

if TYPE_CHECKING:
    from .api import Engine
    from .runtime.core import Runtime

FORMAT = "offload-checkpoint"
VERSION = 1
_TMP = ".{name}.tmp-{pid}-{tag}"


def save(engine: "Engine", rt: "Runtime", path: str | os.PathLike, extra: Any = None) -> None:
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save a checkpoint to {path}: directory {directory} does not exist")
    rt.wait_for_updates()
    scaler = rt.grads.scaler
    content = {
        "format": FORMAT,
        "version": VERSION,
        "model": _model_tensors(engine, rt),
        "optimizer": optimizer_state(engine, rt),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": _rng_state(),
        "extra": extra,
    }
    if rt.ctx.dp is not None:  # issue 20: every rank gathered the shards above; rank 0 writes the one file
        rt.ctx.dp.reads.on_rank0(lambda: _write(directory, name, path, content), f"writing the checkpoint {path}")
    else:
        _write(directory, name, path, content)


def _write(directory: str, name: str, path: str, content: dict) -> None:
    _remove_stale_temporaries(directory, name)
    tmp = os.path.join(directory, _TMP.format(name=name, pid=os.getpid(), tag=uuid.uuid4().hex[:8]))
    try:
        with open(tmp, "wb") as f:
            torch.save(content, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never a mix
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)  # make the rename itself durable


def load(engine: "Engine", rt: "Runtime", path: str | os.PathLike) -> Any:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/EOFError/UnpicklingError/... here
        raise CheckpointError(f"{path} cannot be read as a checkpoint (truncated or corrupt?): {e}") from e
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an offload checkpoint (written by Engine.save)")
    if ck.get("version") != VERSION:
        raise CheckpointError(f"{path} is an offload checkpoint of version {ck.get('version')!r}; this version "
                              f"of offload reads version {VERSION}")
    _check_names_and_shapes(engine, ck["model"], path)
    engine.load_state_dict({"model": ck["model"], "optimizer": ck["optimizer"]})
    scaler = rt.grads.scaler
    if scaler is not None and ck.get("scaler") is not None:
        scaler.load_state_dict(ck["scaler"])
    _set_rng_state(ck["rng"])
    return ck.get("extra")


# -- what is written ------------------------------------------------------------------------------------


def _model_tensors(engine: "Engine", rt: "Runtime") -> dict[str, torch.Tensor]:
    out, by_param = {}, {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        p = rt.ctx.param_index.get(id(value))
        if p is None:
            out[name] = value.detach().cpu()
        else:
            if p not in by_param:  # tied names share one tensor, written once
                by_param[p] = _param_tensor(rt, p)
            out[name] = by_param[p]
    return out


def _param_tensor(rt: "Runtime", p: int) -> torch.Tensor:
    shape = rt.ctx.params[p].shape
    host = rt.slots.host
    if host is None:  # not traced yet: the module still holds its own fp32 tensors
        return rt.warmup.originals()[p].detach()
    if not host.has_master(p):  # frozen, kept in 16 bits only: saved widened to fp32 (a copy)
        return host.read_param(p).view(shape)
    return host.exact("master", host.bucket_of[p], host.offset[p], rt.ctx.specs[p].numel).view(shape)


def optimizer_state(engine: "Engine", rt: "Runtime") -> dict:
    """``optimizer.state_dict()``, with m and v as exact aliases of the arena instead of views of it."""
    sd = engine.optimizer.state_dict()
    host = rt.slots.host
    if host is None:
        return sd
    index = 0
    for group in engine.optimizer.param_groups:
        for param in group["params"]:
            state = sd["state"].get(index)
            p = rt.ctx.param_index.get(id(param))
            # data parallel (issue 20): optimizer.state holds only the step; m and v are gathered from the shards
            if state is not None and p is not None and ("exp_avg" in state or rt.ctx.dp is not None):
                b, off, n = host.bucket_of[p], host.offset[p], rt.ctx.specs[p].numel
                state = sd["state"][index] = dict(state)  # a copy: torch's state_dict() shares optimizer.state's dicts
                state["exp_avg"] = host.exact("exp_avg", b, off, n).view(param.shape)
                state["exp_avg_sq"] = host.exact("exp_avg_sq", b, off, n).view(param.shape)
            index += 1
    return sd


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None, "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is a dependency, but its RNG is only restored when present
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("numpy") is not None:
        import numpy as np
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# -- checks ---------------------------------------------------------------------------------------------


def _check_names_and_shapes(engine: "Engine", model: dict, path: str) -> None:
    own = engine.module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(model))
    unexpected = sorted(set(model) - set(own))
    wrong = sorted(f"{k} {tuple(model[k].shape)} vs {tuple(own[k].shape)}"
                   for k in set(own) & set(model) if tuple(model[k].shape) != tuple(own[k].shape))
    if missing or unexpected or wrong:
        parts = []
        for what, names in (("missing from the checkpoint", missing), ("not in the model", unexpected),
                            ("shape (checkpoint vs model)", wrong)):
            if names:
                shown = ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
                parts.append(f"{what}: {shown}")
        raise CheckpointError(f"{path} is a checkpoint of another model; " + "; ".join(parts))


# -- files ----------------------------------------------------------------------------------------------


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Temporary files left by a save that was killed (its process is gone) are deleted."""
    for tmp in glob.glob(os.path.join(glob.escape(directory), glob.escape(f".{name}.tmp-") + "*")):
        try:
            pid = int(os.path.basename(tmp)[len(f".{name}.tmp-"):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
