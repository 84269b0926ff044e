"""The training state as flat tensors: ``model/<fqn>`` and ``optim/<fqn>/<name>`` (DTensors stay sharded: only
this rank's local shards move), plus the per-rank non-tensor state. The same flattening is used by every tier."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.layout import MODEL_PREFIX, OPTIM_PREFIX, Piece


def local_piece(value: torch.Tensor) -> tuple[torch.Tensor, Piece]:
    """The local tensor of a DTensor (FSDP2: Shard(0), torch.chunk-style uneven last chunk) or a plain tensor."""
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local = value.to_local()
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"DTensor local shape {tuple(local.shape)} != computed {tuple(shape)}")
        return local, Piece(tuple(value.shape), tuple(offset), tuple(shape), value.dtype, True)
    zeros = (0,) * value.ndim
    return value, Piece(tuple(value.shape), zeros, tuple(value.shape), value.dtype, False)


def flatten(state: dict[str, Any], model_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Live tensors of the model and optimizer (the same objects training updates) and the optimizer's non-tensors."""
    if model_only:
        return {MODEL_PREFIX + k: v for k, v in get_model_state_dict(state["model"]).items()}, {}
    model_sd, optim_sd = get_state_dict(state["model"], state["optimizer"])
    live: dict[str, torch.Tensor] = {MODEL_PREFIX + k: v for k, v in model_sd.items()}
    scalars: dict[str, Any] = {}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            key = f"{OPTIM_PREFIX}{fqn}/{name}"
            if isinstance(value, torch.Tensor):
                live[key] = value
            else:
                scalars[key] = value
    groups = [dict(g) for g in optim_sd["param_groups"]]
    return live, {"param_groups": groups, "optim_scalars": scalars}


def local_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Piece], dict[str, Any]]:
    """(local tensors, their pieces, the optimizer's non-tensor state) of this rank."""
    live, extra = flatten(state)
    locals_, pieces = {}, {}
    for key, value in live.items():
        locals_[key], pieces[key] = local_piece(value)
    return locals_, pieces, extra


class LiveState:
    """``local_tensors`` resolved once and reused while the tensors are the same objects: training updates them in
    place, so a snapshot only needs this rank's list of local tensors, not the state-dict API's walk over the model
    and optimizer at every save (about 25 ms for 600 tensors on CPU, on the save's critical path). The optimizer's
    hyperparameters (the learning rate changes every step) and non-tensor state are read fresh each time.

    The cache is checked against the identity of the model's parameters and the optimizer's state tensors (created
    lazily by the first ``optimizer.step()``, replaced by a restore) and dropped by ``invalidate()``."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._locals: dict[str, torch.Tensor] = {}
        self._pieces: dict[str, Piece] = {}
        self._group_fqns: list[Any] = []
        self._scalars: list[tuple[str, dict[str, Any], str]] = []

    def invalidate(self) -> None:
        """Forget the cached tensors, not only the key: they are the attempt's parameters and optimizer state, and
        a reference kept here held a failed attempt's whole state on the device until the next snapshot, beside
        the restarted attempt's (H200, ``1b``: 16.75 GiB more at the in-process restart)."""
        self._key = None
        self._locals, self._pieces, self._group_fqns, self._scalars = {}, {}, [], []

    def get(self, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Piece], dict[str, Any]]:
        """``local_tensors(state)``, from the cache when it is still valid."""
        key = _identity(state)
        optimizer = state["optimizer"]
        if key != self._key:
            self._locals, self._pieces, extra = local_tensors(state)
            self._group_fqns = [g["params"] for g in extra["param_groups"]]
            by_fqn = {fqn: param for group, fqns in zip(optimizer.param_groups, self._group_fqns)
                      for param, fqn in zip(group["params"], fqns)}
            self._scalars = []
            for name_key in extra["optim_scalars"]:
                fqn, name = name_key[len(OPTIM_PREFIX) :].rsplit("/", 1)
                self._scalars.append((name_key, optimizer.state[by_fqn[fqn]], name))
            self._key = key
            return self._locals, self._pieces, extra
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
                  for g, fqns in zip(optimizer.param_groups, self._group_fqns)]
        scalars = {name_key: per_param[name] for name_key, per_param, name in self._scalars}
        return self._locals, self._pieces, {"param_groups": groups, "optim_scalars": scalars}


def _identity(state: dict[str, Any]) -> tuple[Any, ...]:
    optimizer = state["optimizer"]
    return (id(state["model"]), id(optimizer), tuple(id(p) for p in state["model"].parameters()),
            tuple(id(v) for per_param in optimizer.state.values() for v in per_param.values()
                  if isinstance(v, torch.Tensor)))


def rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """Per-rank non-tensor-shard state: step + RNG (TrainProgress), data position, fault-tolerance client state."""
    out = {"progress": state["progress"].state_dict(), "dataloader": state["dataloader"].state_dict()}
    if state.get("ft") is not None:  # FT: the NVRx RankMonitorClient state (learned timeouts) survives restarts
        out["ft"] = state["ft"].state_dict()
    return copy.deepcopy(out)


def apply(state: dict[str, Any], live: dict[str, torch.Tensor], payload: dict[str, Any], restore_ft: bool = True) -> None:
    """Load the filled live tensors back through the state-dict API, then the non-tensor state."""
    model_sd = {k[len(MODEL_PREFIX) :]: v for k, v in live.items() if k.startswith(MODEL_PREFIX)}
    _, optim_sd = get_state_dict(state["model"], state["optimizer"])
    for key, value in live.items():
        if key.startswith(OPTIM_PREFIX):
            fqn, name = key[len(OPTIM_PREFIX) :].rsplit("/", 1)
            optim_sd["state"][fqn][name] = value
    for key, value in payload["optim_scalars"].items():
        fqn, name = key[len(OPTIM_PREFIX) :].rsplit("/", 1)
        optim_sd["state"][fqn][name] = value
    for group, saved in zip(optim_sd["param_groups"], payload["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    set_state_dict(state["model"], state["optimizer"], model_state_dict=model_sd, optim_state_dict=optim_sd)
    apply_rank_state(state, payload["rank_state"], restore_ft)


def apply_rank_state(state: dict[str, Any], saved: dict[str, Any], restore_ft: bool = True) -> None:
    """Load what ``rank_state`` returned: step and RNG, data position, the learned heartbeat timeouts."""
    state["progress"].load_state_dict(saved["progress"])
    state["dataloader"].load_state_dict(saved["dataloader"])
    if restore_ft and state.get("ft") is not None and "ft" in saved:
        state["ft"].load_state_dict(saved["ft"])  # FT: learned heartbeat timeouts


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def predicted_bytes(model: list[Piece], align: int) -> int:
    """This rank's state predicted from the model alone (the optimizer may have no state yet, and creating it
    here would change a fresh run): each parameter, AdamW's two fp32 moments and its step, each ``align``ed."""
    def aligned(nbytes: int) -> int:
        return -(-max(nbytes, 1) // align) * align

    return sum(aligned(p.dtype.itemsize * numel(p.shape)) + 2 * aligned(4 * numel(p.shape)) + aligned(8)
               for p in model)
