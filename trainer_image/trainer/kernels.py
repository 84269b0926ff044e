"""Triton kernels for the eager (not compiled) CUDA path: what ``torch.compile`` fuses, written out by hand.

Eager PyTorch runs each op of the cross-entropy over the ``[tokens, vocab]`` logits and of SwiGLU's ``silu(a) * b``
as its own pass over memory, with a rounding to the activations' dtype between passes. These kernels make each
one pass, with the arithmetic of the compiled path (fp32 inside, one rounding at the end):

- ``cross_entropy_forward``: per row, an online log-sum-exp over the vocabulary (one read of the bf16 logits) and
  the target's log-probability; ``cross_entropy_backward``: ``(exp(logit - lse) - one_hot) * scale`` written over
  the logits (one read, one write). ``trainer/loss.py`` calls them as its chunk kernels, one chunk for all rows;
- ``swiglu``: ``silu(a) * b`` forward, and ``(da, db)`` in one backward kernel; it saves ``a`` and ``b`` for the
  backward, not also ``silu(a)`` as eager autograd does (``1b``, by the arithmetic: 16 x 256 MiB fewer saved);
- ``scaled_upcast``: one rank's gradients to fp32 times clipping's coefficient (``trainer/onerank.py``), compiled or
  not (that pass is outside the compiled graphs), bit-identical to the ``torch.mul`` it replaces;
- ``adamw_step`` (``optim.implementation``, ``auto``'s choice with one rank on CUDA): AdamW reading one rank's
  compute-dtype gradients and the clipping coefficient itself, so the gradient pass above is not run at all.

``train.kernels`` chooses (``trainer/parallel.py``): ``auto`` uses them on CUDA when Triton imports (SwiGLU only in
eager mode: compiled, Inductor fuses it), never on CPU, so CPU runs stay bit-identical to their history.
``compile_ahead`` compiles them for a run's sizes before its first step (``trainer/startup/warmup.py``). Imported
only when chosen (Triton is part of PyTorch's CUDA builds, not of its CPU wheels).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

LOSS_BLOCK = 4096
"""Vocabulary columns one program reads at a time (``1b``'s 128,256 columns: 32 blocks, the last partial)."""
POINTWISE_BLOCK = 1024
UPCAST_BLOCK = 4096


@triton.jit
def _ce_forward_kernel(logits, row_stride, targets, log_prob, lse_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(targets + row)
    tl.store(log_prob + row, tl.load(base + target).to(tl.float32) - lse)
    tl.store(lse_out + row, lse)


@triton.jit
def _ce_backward_kernel(logits, row_stride, targets, lse_in, scale, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    lse = tl.load(lse_in + row)
    target = tl.load(targets + row)
    factor = tl.load(scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0)
        probs = tl.exp(x.to(tl.float32) - lse)
        probs = tl.where(cols == target, probs - 1.0, probs)
        tl.store(base + cols, (probs * factor).to(x.dtype), mask=inside)


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the rows of ``log_softmax(logits.float())[row, target]``, each row's fp32 log-sum-exp)."""
    _check_rows(logits, targets)
    rows, cols = logits.shape
    log_prob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _ce_forward_kernel[(rows,)](logits, logits.stride(0), targets, log_prob, lse, cols, BLOCK=LOSS_BLOCK)
    return log_prob.sum(), lse


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
    """``logits <- (softmax(logits.float()) - one_hot(targets)) * scale``, in place, in one pass."""
    _check_rows(logits, targets)
    rows, cols = logits.shape
    _ce_backward_kernel[(rows,)](logits, logits.stride(0), targets, lse, scale.reshape(1), cols, BLOCK=LOSS_BLOCK)


def _check_rows(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """The kernels index a row's columns from its start: rows of unit stride, one target per row."""
    rows_ok = logits.dim() == 2 and logits.stride(1) == 1
    if not rows_ok or targets.shape != logits.shape[:1] or not targets.is_contiguous():
        raise ValueError(f"cross-entropy kernels need [rows, vocab] logits with unit column stride and [rows] "
                         f"contiguous targets; got {tuple(logits.shape)} stride {logits.stride()} and targets "
                         f"{tuple(targets.shape)}")


@triton.jit
def _swiglu_forward_kernel(a, b, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(a + offsets, mask=inside, other=0.0)
    gate = x.to(tl.float32)
    up = tl.load(b + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + offsets, (gate * tl.sigmoid(gate) * up).to(x.dtype), mask=inside)


@triton.jit
def _swiglu_backward_kernel(grad, a, b, grad_a, grad_b, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    g = tl.load(grad + offsets, mask=inside, other=0.0)
    gate = tl.load(a + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(b + offsets, mask=inside, other=0.0).to(tl.float32)
    g32 = g.to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    tl.store(grad_a + offsets, (g32 * up * sig * (1.0 + gate * (1.0 - sig))).to(g.dtype), mask=inside)
    tl.store(grad_b + offsets, (g32 * silu).to(g.dtype), mask=inside)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        n = a.numel()
        _swiglu_forward_kernel[(triton.cdiv(n, POINTWISE_BLOCK),)](a, b, out, n, BLOCK=POINTWISE_BLOCK)
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        _swiglu_backward_kernel[(triton.cdiv(n, POINTWISE_BLOCK),)](grad, a, b, grad_a, grad_b, n,
                                                                    BLOCK=POINTWISE_BLOCK)
        return grad_a, grad_b


@triton.jit
def _scaled_upcast_kernel(src, out, coef, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = tl.load(src + offsets, mask=inside, other=0.0)
    tl.store(out + offsets, x.to(tl.float32) * tl.load(coef), mask=inside)


def scaled_upcast(grad: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``torch.mul(grad, coef, out=<fp32>)`` for a contiguous gradient, bit for bit (the same fp32 product, one
    rounding), in a kernel with vectorised loads: PyTorch runs a mixed-dtype multiply through its element-at-a-time
    path (``1b``'s 147 gradients: 6.1 ms against a 2.4 ms copy floor, ``bench/onerank_probe.py cast``)."""
    grad = grad.contiguous()  # a copy only if it was not (autograd's gradients of the copies are)
    out = torch.empty_like(grad, dtype=torch.float32)
    n = grad.numel()
    _scaled_upcast_kernel[(triton.cdiv(n, UPCAST_BLOCK),)](grad, out, coef, n, BLOCK=UPCAST_BLOCK)
    return out


@triton.jit
def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, coef, n, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
                  step_size, bc2_sqrt, HAS_COEF: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    g = tl.load(grad + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(coef)
    p = tl.load(param + offsets, mask=inside, other=0.0) * decay
    m = tl.load(exp_avg + offsets, mask=inside, other=0.0)
    v = tl.load(exp_avg_sq + offsets, mask=inside, other=0.0)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(param + offsets, p, mask=inside)
    tl.store(exp_avg + offsets, m, mask=inside)
    tl.store(exp_avg_sq + offsets, v, mask=inside)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               coef: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               step: float) -> None:
    """One AdamW update of a contiguous fp32 parameter and its moments, in place, from a gradient in any float
    dtype times ``coef`` (clipping's coefficient, a 1-element tensor, or None): the gradient pass's upcast and the
    update in one read of each tensor. AdamW's arithmetic, in the order of PyTorch's per-parameter AdamW (decoupled
    decay, the moments by ``lerp`` and ``beta2 v + (1 - beta2) g^2``, bias-corrected, IEEE square root and
    division); the rounding of a fused multiply-add may differ in the last bit."""
    n = param.numel()
    if not all(t.is_contiguous() for t in (param, grad, exp_avg, exp_avg_sq)):
        raise ValueError("adamw_step needs contiguous tensors")
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    _adamw_kernel[(triton.cdiv(n, UPCAST_BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, coef if coef is not None else param, n, 1 - lr * weight_decay, 1 - beta1,
        beta2, 1 - beta2, eps, lr / bc1, bc2 ** 0.5, HAS_COEF=coef is not None, BLOCK=UPCAST_BLOCK)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` in one kernel each way (fp32 inside, one rounding)."""
    return _SwiGLU.apply(a, b)


def compile_ahead(which: frozenset[str], *, vocab: int, activation_numel: int, param_numels: list[int],
                  dtype: torch.dtype, adamw_coef: bool | None) -> Iterator:
    """Compile, without launching anything or allocating memory (``JITFunction.warmup``), the kernels of ``which``
    (``triton_kernels``'s names) and, unless ``adamw_coef`` is None, ``adamw_step`` on the compute-dtype gradients
    (with clipping's coefficient when True), with the argument types and integers the launchers above pass for a
    model of this vocabulary, activation size (tokens x FFN width) and parameter sizes: Triton's cache key is the
    kernel, its constants, each pointer's dtype and each integer's class (1, a multiple of 16, 64-bit), so the run's
    first calls find them in the on-disk cache (``trainer/startup/warmup.py``). Yields Triton's compiled kernels one
    by one, in the order a training step first calls them (SwiGLU's forward in the first block, the loss, its
    backward, SwiGLU's backward, then the optimizer's), so a worker that catches up finds the earliest ones done."""
    f32, i64, grid = torch.float32, torch.int64, (1,)
    loss = "loss" in which
    swiglu = "swiglu" in which
    calls: list = []
    if swiglu:
        calls.append((_swiglu_forward_kernel, (dtype, dtype, dtype, activation_numel), {"BLOCK": POINTWISE_BLOCK}))
    if loss:
        calls += [(_ce_forward_kernel, (dtype, vocab, i64, f32, f32, vocab), {"BLOCK": LOSS_BLOCK}),
                  (_ce_backward_kernel, (dtype, vocab, i64, f32, f32, vocab), {"BLOCK": LOSS_BLOCK})]
    if swiglu:
        calls.append((_swiglu_backward_kernel, (dtype,) * 5 + (activation_numel,), {"BLOCK": POINTWISE_BLOCK}))
    sizes = {(n == 1, n % 16 == 0, n >= 2**31): n for n in param_numels}.values()  # one per integer class
    for n in sizes:
        if "grad_upcast" in which:
            calls.append((_scaled_upcast_kernel, (dtype, f32, f32, n), {"BLOCK": UPCAST_BLOCK}))
        if adamw_coef is not None:
            calls.append((_adamw_kernel, (f32, dtype, f32, f32, f32, n, 0.99, 0.1, 0.95, 0.05, 1e-8, 1e-4, 0.5),
                          {"HAS_COEF": adamw_coef, "BLOCK": UPCAST_BLOCK}))
    for kernel, args, constants in calls:
        yield kernel.warmup(*args, grid=grid, **constants)

