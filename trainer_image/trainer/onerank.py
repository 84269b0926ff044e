"""One rank without FSDP2 (``train.single_rank``): FSDP2's parameters and gradients, without its copies.

FSDP2 on one rank still moves the data its collectives would: every forward casts each fp32 parameter to bf16 and
copies the result into the unsharded parameter; every backward concatenates the bf16 gradients into an fp32
reduce-scatter buffer and copies that into the sharded gradient (on the 1b model on an H200, most of the 14.5 ms
of copies in a 274 ms step); gradient clipping then reads the fp32 gradients twice (norm, scale). With one rank
the reduction is the identity, so the same values come from less work:

- the parameters are the one-rank ``DTensor``s (``Shard(0)``) FSDP2 would make: the optimizer and the checkpoint
  (its pieces, its layout across world sizes) see exactly what they see under FSDP2;
- a forward pre-hook on the model puts a copy of each parameter's local tensor in the compute dtype on the
  modules for the length of the forward (a leaf tensor; fp32 compute uses the local tensor itself), then the
  parameters go back; autograd accumulates the gradients on those copies, in the compute dtype, as FSDP2
  accumulates them on its unsharded parameters (a tied parameter: one copy, both gradients);
- at the end of the backward (an autograd callback) each gradient becomes the fp32 gradient of its ``DTensor``
  parameter in one pass: ``fp32(g) * c``, where ``c`` is gradient clipping's coefficient when the model was built
  with ``grad_clip`` (``min(1, max_norm / (norm + 1e-6))``, the norm taken over the fp32 values of the bf16
  gradients: ``torch.nn.utils.clip_grad_norm_``'s arithmetic), else 1. ``clip_grad_norm_`` here returns that norm.

With ``reshard_blocks`` (``train.reshard_after_forward``: every transformer block but the last), the copies are
resharded as FSDP2's ``reshard_after_forward`` reshards its unsharded parameters, with a cast for the all-gather:
after a block's forward (with grad enabled, and an output that requires grad) the storage of its copies is freed
(``untyped_storage().resize_(0)``, the tensors stay, so autograd's saved references and the copies' ``.grad``
stay as they are), and a gradient hook on the block's output gives it back and casts the fp32 master into it again
right before the block's backward (``copy_``: the round-to-nearest of ``.to(bf16)``, so the backward reads the very
values the forward did, unless the parameter changed in between: the backward reads its current values, as FSDP2's
all-gather would). On the 1b model that frees 15 blocks x 60.8M parameters x 2 bytes = 1.70 GiB during the forward
and at the start of the backward (the peak: activations and logits), for one more cast of those parameters per
step. Not resharded: the last block (its backward comes right away), parameters outside the blocks (embedding,
final norm, output), a parameter a block shares with another module, and fp32 compute (the "copy" is the master
itself). A forward that raises or whose backward never runs leaves freed copies that only that forward's graph and
``pending`` hold: the next forward casts fresh ones, and ``finish_gradients`` reads only their (absent) gradients.
Otherwise the copies live as long as FSDP2's unsharded parameters do without resharding (from the forward to the end
of the backward). With ``grad_clip``, every backward is clipped when it ends: one backward per optimizer step, as
the trainer's loop does (gradient accumulation would clip each micro-batch; the trainer has none).

Activation checkpointing recomputes a block's forward inside the backward, when the fp32 parameters are back on
the modules: with it, one rank uses FSDP2 (``train.single_rank=auto``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves


Upcast = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_scaled_upcast(grad: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``grad`` in fp32 times ``coef`` (a 1-element tensor): fp32 arithmetic on the upcast values, one pass."""
    return torch.mul(grad, coef, out=torch.empty_like(grad, dtype=torch.float32))


class OneRank:
    """The model's parameters as one-rank DTensors, copied to ``compute_dtype`` for each forward and backward."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device, grad_clip: float,
                 reshard_blocks: Sequence[nn.Module] = (), scaled_upcast: Upcast | None = None) -> None:
        self.compute_dtype = compute_dtype
        self.scaled_upcast = scaled_upcast or torch_scaled_upcast
        """(gradient, coefficient) -> the fp32 gradient times it: ``torch.mul``, or ``trainer/kernels.py``'s."""
        self.grad_clip = grad_clip
        self.mesh = init_device_mesh(device.type, (1,))
        self.masters: list[nn.Parameter] = []
        self.slots: list[tuple[nn.Module, str, int]] = []
        """Every (module, name) that holds a parameter, with the parameter's index in ``masters``."""
        index: dict[int, int] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in index:  # one rank: the local shard is the whole tensor (no copy, no collective)
                    index[id(param)] = len(self.masters)
                    self.masters.append(nn.Parameter(
                        DTensor.from_local(param.detach(), self.mesh, [Shard(0)], run_check=False),
                        requires_grad=param.requires_grad))
                module._parameters[name] = self.masters[index[id(param)]]
                self.slots.append((module, name, index[id(param)]))
        self.handing_over = False
        """Set by an optimizer that reads the compute-dtype gradients itself (``hand_over_gradients``)."""
        self.handed: dict[int, torch.Tensor] = {}
        self.handed_coef: torch.Tensor | None = None
        self.pending: list[list[torch.Tensor]] = []
        """The compute-dtype copies (leaves) of each forward whose backward has not ended yet (one per step)."""
        self.last_norm: torch.Tensor | None = None
        self.depth = 0  # a forward inside the forward (none today) uses the outer one's copies
        self.resharded: list[tuple[nn.Module, list[tuple[nn.Module, str, int]]]] = []
        """Each block of ``reshard_blocks`` with the slots of its own real copies (see the module's docstring)."""
        owners: dict[int, set[int]] = {}  # parameter index -> the blocks (or -1: any other module) that hold it
        block_of = {id(m): b for b, block in enumerate(reshard_blocks) for m in block.modules()}
        for owner, _, i in self.slots:
            owners.setdefault(i, set()).add(block_of.get(id(owner), -1))
        for b, block in enumerate(reshard_blocks):
            own = [(owner, name, i) for owner, name, i in self.slots if owners[i] == {b}
                   and self.masters[i].dtype != compute_dtype]
            if own:
                self.resharded.append((block, own))

    @classmethod
    def apply(cls, model: nn.Module, compute_dtype: torch.dtype, device: torch.device,
              grad_clip: float = 0.0, reshard_blocks: Sequence[nn.Module] = (),
              scaled_upcast: Upcast | None = None) -> nn.Module:
        """``model`` run by a ``OneRank``; ``reshard_blocks``: submodules whose copies are freed after their forward
        and cast again for their backward (a module wrapped by ``torch.compile``: the wrapper, as called)."""
        one_rank = cls(model, compute_dtype, device, grad_clip, reshard_blocks, scaled_upcast)
        model.register_forward_pre_hook(one_rank.before_forward)
        model.register_forward_hook(one_rank.after_forward, always_call=True)  # also when the forward raises
        for block, own in one_rank.resharded:
            block.register_forward_pre_hook(lambda module, args, own=own: one_rank._unshard(one_rank._copies(own)))
            block.register_forward_hook(
                lambda module, args, output, own=own: one_rank._reshard(one_rank._copies(own), output))
        model._one_rank = one_rank  # type: ignore[assignment]
        zero_grad = model.zero_grad

        def zero_grad_and_handed(set_to_none: bool = True) -> None:  # e.g. after a warm-up's discarded backward
            one_rank.take_gradients()
            zero_grad(set_to_none)

        model.zero_grad = zero_grad_and_handed  # type: ignore[method-assign]
        return model

    def hand_over_gradients(self) -> Callable[[], tuple[dict[int, torch.Tensor], torch.Tensor | None]]:
        """For an optimizer that applies clipping's coefficient and the upcast itself (``optim.implementation=
        triton``): from now on a backward with no gradients before it leaves its compute-dtype gradients here, not
        converted, and the parameters' ``.grad`` stays None. Returns ``take_gradients``."""
        self.handing_over = True
        return self.take_gradients

    def take_gradients(self) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """({id(parameter): its compute-dtype gradient}, clipping's coefficient or None), given up by this object."""
        handed, coef = self.handed, self.handed_coef
        self.handed, self.handed_coef = {}, None
        return handed, coef

    def before_forward(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        grad = torch.is_grad_enabled()
        copies = []
        for master in self.masters:
            local = master.to_local().detach()
            copy = local if local.dtype == self.compute_dtype else local.to(self.compute_dtype)
            copies.append(copy.requires_grad_(grad and master.requires_grad))
        for owner, name, i in self.slots:
            owner._parameters[name] = copies[i]  # type: ignore[assignment]  # a tensor, as functional_call does
        if grad:
            self.pending.append(copies)

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth:
            return
        for owner, name, i in self.slots:
            owner._parameters[name] = self.masters[i]
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_backward)  # the first gradient of the backward through the model
        elif torch.is_grad_enabled() and self.pending:  # this forward has no backward (or it raised)
            self.pending.pop()

    def _copies(self, own: list[tuple[nn.Module, str, int]]) -> list[tuple[torch.Tensor, int]]:
        """The copies now on a block's modules with their masters' indices; none outside the model's forward."""
        if not self.depth:  # the block called on its own: its modules hold the masters
            return []
        seen: dict[int, tuple[torch.Tensor, int]] = {}
        for owner, name, i in own:
            seen.setdefault(i, (owner._parameters[name], i))  # type: ignore[arg-type]
        return list(seen.values())

    def _reshard(self, copies: list[tuple[torch.Tensor, int]], output: Any) -> None:
        """After a block's forward: free its copies' storage until its backward starts (a gradient hook on each
        output tensor; the first to run gives the storage back). Only when that backward can come."""
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        copies = [(copy, i) for copy, i in copies if copy.is_contiguous() and copy.storage_offset() == 0]
        if not copies or not outputs or not torch.is_grad_enabled():
            return
        for copy, _ in copies:
            copy.untyped_storage().resize_(0)
        for t in outputs:
            t.register_hook(lambda grad: self._unshard(copies))

    @torch.no_grad()
    def _unshard(self, copies: list[tuple[torch.Tensor, int]]) -> None:
        """Give freed copies their storage back and cast their masters into it again (the value ``.to`` gave)."""
        freed = [(copy, i) for copy, i in copies if copy.untyped_storage().size() == 0]
        if not freed:
            return
        targets = tuple(copy for copy, _ in freed)
        for copy in targets:
            copy.untyped_storage().resize_(copy.numel() * copy.element_size())
        # autograd saved these tensors in the forward: the refill must not count as an in-place change (FSDP2's
        # all-gather copy-out into its unsharded parameters does the same)
        with torch.autograd._unsafe_preserve_version_counter(targets):
            torch._foreach_copy_(list(targets), [self.masters[i].to_local() for _, i in freed])

    def _on_backward(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradients)  # at the backward's end
        return grad

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Each copy's gradient, times clipping's coefficient, as the fp32 gradient of its parameter. Clipping
        needs the whole step's gradient: it is applied only to one forward's gradients with none already on the
        parameters; otherwise they are added unclipped and ``clip_grad_norm_`` clips as usual."""
        pending, self.pending = self.pending, []
        self.last_norm = None
        if self.handed:  # a second backward before the optimizer took the first's: those become .grad as usual
            handed, coef = self.take_gradients()
            for master in self.masters:
                if (grad := handed.pop(id(master), None)) is not None:
                    self._add_grad(master, grad, coef)
        fresh = len(pending) == 1 and all(m.grad is None for m in self.masters)
        for copies in pending:
            grads: list[torch.Tensor | None] = [c.grad for c in copies]
            copies.clear()  # the compute-dtype copies go now; each gradient goes once converted
            present = [g for g in grads if g is not None]
            coef = None
            if fresh and self.grad_clip > 0 and present:
                norms = torch._foreach_norm(present, 2.0, dtype=torch.float32)
                self.last_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
                coef = torch.clamp(self.grad_clip / (self.last_norm + 1e-6), max=1.0).reshape(1)
            del present
            if fresh and self.handing_over:
                self.handed = {id(m): g for m, g in zip(self.masters, grads) if g is not None}
                self.handed_coef = coef
                continue
            for i, master in enumerate(self.masters):
                grad, grads[i] = grads[i], None
                if grad is not None:
                    self._add_grad(master, grad, coef)
                    del grad  # each compute-dtype gradient goes once converted

    def _add_grad(self, master: nn.Parameter, grad: torch.Tensor, coef: torch.Tensor | None) -> None:
        """``grad`` (compute dtype) in fp32, times ``coef`` when given, as ``master``'s gradient or added to it."""
        grad32 = grad.to(torch.float32) if coef is None else self.scaled_upcast(grad, coef)
        if master.grad is None:
            master.grad = DTensor.from_local(grad32, self.mesh, [Shard(0)], run_check=False)
        else:
            master.grad.to_local().add_(grad32)


def is_one_rank(model: nn.Module) -> bool:
    """Whether ``model`` runs without FSDP2 (``OneRank``)."""
    return isinstance(getattr(model, "_one_rank", None), OneRank)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the model's parameters; a ``OneRank`` model built with this
    ``grad_clip`` clipped when its backward ended: its norm, nothing to do."""
    one_rank = getattr(model, "_one_rank", None)
    if isinstance(one_rank, OneRank) and one_rank.grad_clip == max_norm and one_rank.last_norm is not None:
        norm, one_rank.last_norm = one_rank.last_norm, None
        return norm
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
