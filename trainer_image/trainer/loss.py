"""The training loss: mean next-token cross-entropy, in fp32 whatever the logits' dtype.

``ChunkedCrossEntropy`` (``train.chunked_loss``, on by default) computes the same thing as ``model.cross_entropy``
(``F.cross_entropy(logits.float(), targets)``) row chunk by row chunk, and writes its gradient over the logits:

- forward: per chunk, the fp32 log-softmax of the target token, summed; nothing of size ``[tokens, vocab]`` is
  kept but the logits themselves, which the plain loss keeps too (compiled: plus one fp32 log-sum-exp per token);
- backward: per chunk, ``(softmax - one_hot) * grad / tokens`` in fp32, rounded to the logits' dtype and written
  into the logits' own buffer, which is then returned as their gradient.

For the 1b model (16,384 tokens x 128,256 vocabulary) that removes the 4 GiB bf16 gradient buffer of the plain
loss and, in eager mode, its fp32 copies of the logits (8 GiB each for the upcast, the log-softmax output kept for
the backward, and its gradient). The arithmetic is the plain loss's: fp32 softmax of the bf16 logits, one rounding
of the gradient to bf16; only the order of the final sum over tokens differs. Compiled (``train.compile`` with
``train.compile_loss``), each chunk's forward and backward are one fused Inductor kernel each.

The logits are consumed: after the backward their buffer holds the gradient. The model calls the loss on logits
nothing else uses (``Transformer.forward(tokens, targets)``); the output projection's backward needs only its
input and weight. Every target counts (the trainer's batches have no padding, so no ``ignore_index``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

CHUNK_BYTES = 1 << 30
"""Size of one chunk's fp32 ``[rows, vocab]`` working set (eager mode: one such tensor alive at a time)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build(chunked: bool, compiled: bool, plain: LossFn, triton: bool = False) -> LossFn:
    """The loss the model calls: ``ChunkedCrossEntropy`` or ``plain``, compiled when ``compiled``; ``triton``
    (CUDA, ``train.kernels``): the chunked loss's kernels from ``trainer/kernels.py``, compiled or not."""
    if chunked:
        return ChunkedCrossEntropy(compiled, triton=triton)
    return torch.compile(plain) if compiled else plain


def row_chunks(rows: int, vocab: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` row ranges of near-equal size whose fp32 ``[rows, vocab]`` block fits ``chunk_bytes``
    (default ``CHUNK_BYTES``; near-equal sizes: a compiled chunk kernel sees at most two shapes)."""
    count = max(1, math.ceil(rows * vocab * 4 / (chunk_bytes or CHUNK_BYTES)))
    count = min(count, rows)
    bounds = [rows * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def eager_forward(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
    """(sum over the rows of ``log_softmax(logits.float())[row, target]``, nothing saved): one log-softmax
    kernel reading the logits and writing fp32, and a gather."""
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    return log_probs.gather(1, targets.unsqueeze(1)).sum(), None


def eager_backward(logits: torch.Tensor, targets: torch.Tensor, saved: None, scale: torch.Tensor) -> None:
    """``logits <- (softmax(logits.float()) - one_hot(targets)) * scale`` in place, in as few eager passes as
    there are: the softmax into fp32, a scatter of one element per row, the scaled cast back."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    probs.scatter_add_(1, targets.unsqueeze(1), probs.new_full((probs.shape[0], 1), -1.0))
    torch.mul(probs, scale, out=logits)


def fused_forward(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For Inductor (one reduction over the logits): the same sum, and each row's fp32 log-sum-exp, kept for
    the backward (one float per token)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    return (x.gather(1, targets.unsqueeze(1)).squeeze(1) - lse).sum(), lse


def fused_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
    """For Inductor (one pointwise pass, in place): ``(exp(logits - lse) - one_hot(targets)) * scale``."""
    probs = torch.exp(logits.float() - lse.unsqueeze(1))
    column = torch.arange(logits.shape[1], device=logits.device)
    probs = torch.where(column == targets.unsqueeze(1), probs - 1.0, probs)
    logits.copy_(probs * scale)


class ChunkedCrossEntropy:
    """Mean cross-entropy of ``logits`` ``[..., vocab]`` against ``targets`` ``[...]``; consumes ``logits``.

    Eager, the backward recomputes each chunk's softmax (cheaper in eager kernels than keeping anything);
    compiled, the forward keeps each row's log-sum-exp and the backward is a single pointwise kernel; ``triton``:
    the same two kernels written by hand (``trainer/kernels.py``), over all rows at once (no fp32 working set)."""

    def __init__(self, compiled: bool = False, triton: bool = False) -> None:
        self.compiled, self.one_chunk = compiled, triton
        if triton:
            from trainer import kernels

            self.forward_chunk, self.backward_chunk = kernels.cross_entropy_forward, kernels.cross_entropy_backward
        elif compiled:
            self.forward_chunk = torch.compile(fused_forward, dynamic=False)
            self.backward_chunk = torch.compile(fused_backward, dynamic=False)
        else:
            self.forward_chunk, self.backward_chunk = eager_forward, eager_backward

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _InPlaceCrossEntropy.apply(logits, targets, self)


class _InPlaceCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, kernels: ChunkedCrossEntropy) -> torch.Tensor:
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        chunks = [(0, flat.shape[0])] if kernels.one_chunk else row_chunks(*flat.shape)
        total, saved = None, []
        for start, stop in chunks:
            part, keep = kernels.forward_chunk(flat[start:stop], flat_targets[start:stop])
            total = part if total is None else total + part
            saved.append(keep)
        # Not save_for_backward: the buffer is overwritten on purpose (nothing else saved the logits).
        ctx.buffer, ctx.targets, ctx.kernels, ctx.chunks, ctx.saved = flat, flat_targets, kernels, chunks, saved
        ctx.shape = logits.shape
        return -total / flat.shape[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        flat, ctx.buffer = ctx.buffer, None
        scale = grad.float() / flat.shape[0]
        for (start, stop), keep in zip(ctx.chunks, ctx.saved):
            ctx.kernels.backward_chunk(flat[start:stop], ctx.targets[start:stop], keep, scale)
        ctx.saved = None
        return flat.view(ctx.shape), None, None
