"""AdamW stepped on the local shards of ``DTensor`` parameters.

PyTorch 2.10 and 2.11 leak host memory when ``torch.optim.AdamW`` (fused or foreach) steps over ``DTensor``
parameters, as FSDP2 and ``OneRank`` make them: DTensor's dispatch wraps each per-parameter ``step`` scalar tensor
in a new ``DTensorSpec`` on every call, and those are never freed (pytorch/pytorch#181761, #188174). Measured on an
H200 with the ``1b`` model (torch 2.11): ~1,800 objects more per step, 788k live objects by step 405. Host memory
grows without bound over a long job, and every in-process restart's full garbage collections (NVRx's Wrapper) scan
them all: 0.83 s at step 405.

The update of a sharded parameter is elementwise, so DTensor's dispatch only runs the same op on the local shards.
``LocalShardAdamW.step`` does that directly: for the length of the step the optimizer sees each parameter's local
tensor, its gradient's local tensor and its state's local tensors (the same storage: updates land in the DTensors),
and the parent's ``step`` runs unchanged on plain tensors. The arithmetic and the kernels are AdamW's; the state
stays ``DTensor``s (checkpoints, resharding across world sizes and the trainer's snapshots see what they saw).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from trainer.config import ConfigError, OptimConfig
from trainer.parallel import triton_missing

Handed = Callable[[], "tuple[dict[int, torch.Tensor], torch.Tensor | None]"]
"""A ``OneRank``'s ``take_gradients``: ({id(parameter): its compute-dtype gradient}, clipping's coefficient)."""


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs on local shards (see the module's docstring).

    ``triton`` (``optim.implementation``, ``auto``'s choice on CUDA with one rank): each parameter is updated by one
    kernel (``trainer/kernels.py``'s ``adamw_step``); with ``handed`` (one rank), the gradients are read in the compute
    dtype with clipping's coefficient, straight from ``OneRank``, which then skips its fp32 gradient pass. The state
    is AdamW's per-parameter one (``step`` a CPU tensor, the moments like the parameter): checkpoints move between
    implementations."""

    def __init__(self, params: Any, *, triton: bool = False, handed: Handed | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.triton, self.handed = triton, handed
        if triton and (kwargs.get("amsgrad") or kwargs.get("maximize")):
            raise ValueError("optim.implementation=triton has no amsgrad or maximize")

    @torch.no_grad()
    def init_state(self) -> bool:
        """Give every parameter the state its first step would create (``step`` 0, zero moments), without a step;
        False (nothing done) when there is state already. A restore reads the state's tensors through the state-dict
        API, which otherwise creates them with a step of zero gradients at lr 0 (``_init_optim_state``): gradients
        allocated and zeroed, a kernel per parameter, and on the first restart of a process the kernels for that
        step loaded (BENCHMARKS.md, "Recovery per layer": the restore's ``state dict`` part)."""
        if self.state:
            return False
        for group in self.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable")) and not self.triton
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.state[p]
                if on_device:  # as AdamW's first step makes them
                    state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=bool(group.get("fused"))),
                                                device=_local(p).device)
                else:
                    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = _state_like(p)
                state["exp_avg_sq"] = _state_like(p)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = _state_like(p)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.handed is not None:
            self.handed()  # a step that was not taken: its gradients go too
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.triton:
            self._triton_step()
            return loss
        swapped: list[tuple[dict[str, Any], list[Any]]] = []
        shards: list[tuple[DTensor, torch.Tensor, dict[str, Any]]] = []
        try:
            for group in self.param_groups:
                params = group["params"]
                local_params = []
                for p in params:
                    if not isinstance(p, DTensor):
                        local_params.append(p)
                        continue
                    local = p.to_local()  # under no_grad: the shard itself, not a copy
                    before = self.state.get(p, {})
                    local.grad = None if p.grad is None else p.grad.to_local()
                    self.state[local] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in before.items()}
                    shards.append((p, local, before))
                    local_params.append(local)
                swapped.append((group, params))
                group["params"] = local_params
            super().step()
        finally:
            for group, params in swapped:
                group["params"] = params
            for p, local, before in shards:
                after = self.state.pop(local, {})
                self.state[p] = {k: _keep(before.get(k), v, p) for k, v in after.items()}
                local.grad = None
        return loss

    def _triton_step(self) -> None:
        from trainer import kernels

        handed, coef = self.handed() if self.handed is not None else ({}, None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad, scale = handed.get(id(p)), coef
                if grad is None:
                    if p.grad is None:
                        continue
                    grad, scale = _local(p.grad), None  # converted (and clipped) already
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = _state_like(p)
                    state["exp_avg_sq"] = _state_like(p)
                elif state["step"].device.type != "cpu":  # from a fused run's checkpoint: read on the host from now on
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                kernels.adamw_step(_local(p), grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), scale,
                                   lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                   weight_decay=group["weight_decay"], step=float(state["step"]))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_like(param: torch.Tensor) -> torch.Tensor:
    """A zero moment like ``param``: a ``DTensor`` like it when it is one, as AdamW makes them."""
    zeros = torch.zeros_like(_local(param), memory_format=torch.preserve_format)
    return _as_dtensor(zeros, param) if isinstance(param, DTensor) else zeros


def _keep(old: Any, new: Any, param: DTensor) -> Any:
    """The state entry of ``param`` after a step on its shard: the ``DTensor`` it was (its shard updated in place),
    a new per-element tensor (the first step's moments) as a ``DTensor`` like ``param``, anything else as is (the
    ``step`` scalar, which AdamW keeps as a plain tensor on ``DTensor`` parameters too)."""
    if isinstance(old, DTensor) and old.to_local() is new:
        return old
    if isinstance(new, torch.Tensor) and new.dim() > 0 and new.shape == param.to_local().shape:
        return _as_dtensor(new, param)
    return new


def _as_dtensor(tensor: torch.Tensor, like: DTensor) -> DTensor:
    """A state tensor made by the step on ``like``'s shard, as the ``DTensor`` AdamW would have made on ``like``."""
    return DTensor.from_local(tensor, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


ADAMW_OPTIONS: dict[str, dict[str, Any]] = {"fused": {"fused": True}, "foreach": {"foreach": True},
                                           "for_loop": {"foreach": False}, "triton": {"triton": True}}
"""``torch.optim.AdamW``'s (``LocalShardAdamW``'s) options for each ``adamw_implementation``."""


def adamw_implementation(cfg: OptimConfig, device: torch.device, one_rank: bool = False) -> str:
    """``auto``: on GPU, with one rank (``OneRank``) and Triton, the Triton kernel that reads the bf16 gradients
    itself, else the fused CUDA kernel (both elementwise, so reruns stay deterministic); on CPU the per-parameter
    loop, whose results are bit-identical between runs and world sizes."""
    if cfg.implementation == "triton" and device.type != "cuda":
        raise ConfigError("optim.implementation=triton runs on CUDA only: set optim.implementation=auto on CPU")
    if cfg.implementation != "auto":
        return cfg.implementation
    if device.type != "cuda":
        return "for_loop"
    return "triton" if one_rank and not triton_missing() else "fused"
