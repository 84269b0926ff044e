"""One rank without FSDP2 (``train.single_rank``): FSDP2's parameters and gradients, none of its copies.

FSDP2 on one rank still runs its collectives' data movement. Every forward casts each fp32 parameter to bf16 and
copies the result into the unsharded parameter; every backward concatenates the bf16 gradients into an fp32
reduce-scatter buffer and copies that into the sharded gradient (on the 1b model on an H200: 14.5 ms of a 274 ms
step). With one rank the reduction is the identity, so the same values come from far less work:

- the parameters are the one-rank ``DTensor``s (``Shard(0)``) FSDP2 would make: the optimizer, gradient clipping
  and the checkpoint (its pieces, its layout across world sizes) see exactly what they see under FSDP2;
- a forward pre-hook on the model puts, for the length of the forward, each parameter's local tensor cast to the
  compute dtype (``to_local().to(bf16)``, differentiable) in its place on the modules, then the parameters go back;
- autograd sends each bf16 gradient through the cast's backward: an fp32 gradient of the ``DTensor`` parameter,
  equal to the one FSDP2 reduces over one rank.

So one cast per parameter each way, nothing else. The bf16 copies live as long as the backward needs them (the
autograd graph holds them), as FSDP2's unsharded parameters do without resharding. Tied parameters (one tensor in
two modules) are cast once and accumulate their bf16 gradients before the cast back, as in FSDP2.

Activation checkpointing recomputes a block's forward inside the backward, when the fp32 parameters are back on
the modules: with it, one rank uses FSDP2 (``train.single_rank=auto``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


class OneRank:
    """The model's parameters as one-rank DTensors, cast to ``compute_dtype`` for each forward."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> None:
        self.compute_dtype = compute_dtype
        mesh = init_device_mesh(device.type, (1,))
        masters: dict[int, nn.Parameter] = {}
        self.slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        """Every (module, name) that holds a parameter; a tied parameter appears once per module."""
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                master = masters.get(id(param))
                if master is None:
                    master = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]),
                                          requires_grad=param.requires_grad)
                    masters[id(param)] = master
                module._parameters[name] = master
                self.slots.append((module, name, master))
        self.depth = 0  # a forward inside the forward (none today) reuses the outer one's casts

    @classmethod
    def apply(cls, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
        one_rank = cls(model, compute_dtype, device)
        model.register_forward_pre_hook(one_rank.before_forward)
        model.register_forward_hook(one_rank.after_forward, always_call=True)  # also when the forward raises
        model._one_rank = one_rank  # type: ignore[assignment]
        return model

    def before_forward(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        casts: dict[int, torch.Tensor] = {}
        for owner, name, master in self.slots:
            cast = casts.get(id(master))
            if cast is None:
                local = master.to_local()
                cast = local if local.dtype == self.compute_dtype else local.to(self.compute_dtype)
                casts[id(master)] = cast
            owner._parameters[name] = cast  # type: ignore[assignment]  # a tensor, as torch.func.functional_call does

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth:
            return
        for owner, name, master in self.slots:
            owner._parameters[name] = master


def is_one_rank(model: nn.Module) -> bool:
    """Whether ``model`` runs without FSDP2 (``OneRank``)."""
    return isinstance(getattr(model, "_one_rank", None), OneRank)
