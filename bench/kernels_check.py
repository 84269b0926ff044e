"""trainer/kernels.py against PyTorch's eager ops on the GPU, at the ``1b`` run's shapes: the largest difference of
each output (Triton against eager, both against an fp32 reference) and each side's time on the GPU's timeline.

    source bench/gpu_env.sh && python bench/kernels_check.py        (a CUDA machine with Triton; ~20 s)
    TRITON_INTERPRET=1 python bench/kernels_check.py --dry-run       (a CPU with Triton installed: small shapes)

One JSON line per kernel: {"figure": "kernel_check", "kernel", ..., "passed"}. The loss and SwiGLU: each side's
largest absolute difference from an fp32 reference (``max_err_eager``, ``max_err_triton``) and GPU time; passed
when the Triton kernel's is no larger than twice eager PyTorch's own or one bf16 unit in the last place of the
largest reference value (``bf16_ulp``: both round to bf16 once or more). The gradient pass: bit-identical
(``tensors_not_bit_identical``: 0). AdamW: within 2 fp32 ulps of PyTorch's fused AdamW after one step
(``max_err_vs_fused``, ``tolerance``). Exit 1 when one does not pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))
from trainer import kernels, loss  # noqa: E402
from trainer.onerank import torch_scaled_upcast  # noqa: E402

TOKENS, VOCAB, FFN = 4 * 4096, 128_256, 8192
DEVICE = "cuda"
if "--dry-run" in sys.argv:  # TRITON_INTERPRET=1 on a CPU: the script's logic at small shapes, no timings
    TOKENS, VOCAB, FFN, DEVICE = 64, 5000, 256, "cpu"


def gpu_ms(fn, repeat: int = 10) -> float:
    if DEVICE == "cpu":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def parameter_shapes() -> list[torch.Size]:
    """Every ``1b`` parameter's shape (a small model's with ``--dry-run``), from a model on the meta device."""
    from trainer.config import load_config
    from trainer.model import Transformer

    cfg = load_config("1b", ["data.path=unused"]).model
    if DEVICE == "cpu":
        cfg.dim, cfg.n_layers, cfg.ffn_dim, cfg.vocab_size = 256, 2, 512, VOCAB
    with torch.device("meta"):
        return [p.shape for p in Transformer(cfg, 64).parameters()]


def within_rounding(results: dict) -> dict:
    """``passed``: the Triton kernel's largest error is no larger than twice eager PyTorch's own or one bf16 ulp."""
    return {**results, "passed": results["max_err_triton"] <= max(2 * results["max_err_eager"], results["bf16_ulp"])}


def check_loss() -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(TOKENS, VOCAB, device=DEVICE, generator=gen) * 2).bfloat16()
    targets = torch.randint(0, VOCAB, (TOKENS,), device=DEVICE, generator=gen)
    ref = logits.float().requires_grad_()
    ref_loss = F.cross_entropy(ref, targets)
    ref_loss.backward()

    def run(triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.clone().requires_grad_()
        y = x * 1  # the loss consumes (overwrites) its input
        out = loss.ChunkedCrossEntropy(triton=triton)(y, targets)
        out.backward()
        return out.detach(), x.grad

    results = {"bf16_ulp": float(ref.grad.abs().max()) * 2 ** -7}
    for name, triton in (("eager", False), ("triton", True)):
        value, grad = run(triton)
        err = max(float((value - ref_loss.detach()).abs()), float((grad.float() - ref.grad).abs().max()))
        results[f"max_err_{name}"] = err
        results[f"{name}_ms"] = round(gpu_ms(lambda triton=triton: run(triton)), 3)
        del value, grad
    return {"kernel": "cross_entropy (forward + backward, with one copy of the logits)", **within_rounding(results)}


def check_swiglu() -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    a = torch.randn(TOKENS, FFN, device=DEVICE, generator=gen).bfloat16()
    b = torch.randn(TOKENS, FFN, device=DEVICE, generator=gen).bfloat16()
    grad = torch.randn(TOKENS, FFN, device=DEVICE, generator=gen).bfloat16()
    ra, rb = a.float().requires_grad_(), b.float().requires_grad_()
    ref = F.silu(ra) * rb
    ref.backward(grad.float())
    results = {"bf16_ulp": max(float(t.detach().abs().max()) for t in (ref, ra.grad, rb.grad)) * 2 ** -7}
    for name, fn in (("eager", lambda x, y: F.silu(x) * y), ("triton", kernels.swiglu)):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(x, y)
        out.backward(grad)
        results[f"max_err_{name}"] = max(float((out.detach().float() - ref.detach()).abs().max()),
                                         float((x.grad.float() - ra.grad).abs().max()),
                                         float((y.grad.float() - rb.grad).abs().max()))

        def step(fn=fn):
            x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
            fn(x, y).backward(grad)

        results[f"{name}_ms"] = round(gpu_ms(step), 3)
    return {"kernel": "swiglu (forward + backward, with copies of a and b)", **within_rounding(results)}


def check_grad_upcast() -> dict:
    """One rank's gradient pass: every ``1b`` gradient (bf16) to fp32 times a coefficient; bit for bit."""
    shapes = parameter_shapes()
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    grads = [torch.randn(shape, device=DEVICE, generator=gen).bfloat16() for shape in shapes]
    coef = torch.tensor([0.37], device=DEVICE)
    eager = [torch_scaled_upcast(g, coef) for g in grads]
    mine = [kernels.scaled_upcast(g, coef) for g in grads]
    differ = sum(int(not torch.equal(a, b)) for a, b in zip(eager, mine))
    del eager, mine
    results = {"tensors": len(grads), "tensors_not_bit_identical": differ, "passed": differ == 0}
    results["eager_ms"] = round(gpu_ms(lambda: [torch_scaled_upcast(g, coef) for g in grads]), 3)
    results["triton_ms"] = round(gpu_ms(lambda: [kernels.scaled_upcast(g, coef) for g in grads]), 3)
    return {"kernel": "grad_upcast (every 1b gradient, bf16 -> fp32 x coefficient)", **results}


def check_adamw() -> dict:
    """One AdamW step over every ``1b`` parameter: the gradient pass then PyTorch's fused AdamW (the default), against
    ``adamw_step`` reading the bf16 gradients and the coefficient itself (``optim.implementation=triton``)."""
    shapes = parameter_shapes()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    params = [torch.randn(shape, device=DEVICE, generator=gen) for shape in shapes]
    grads = [torch.randn(shape, device=DEVICE, generator=gen).bfloat16() for shape in shapes]
    coef = torch.tensor([0.37], device=DEVICE)
    hyper = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def torch_side() -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        leaves = [torch.nn.Parameter(p.clone()) for p in params]
        opt = torch.optim.AdamW(leaves, fused=DEVICE == "cuda", foreach=False if DEVICE == "cpu" else None, **hyper)
        return leaves, opt

    def torch_step(leaves, opt) -> None:
        for leaf, g in zip(leaves, grads):
            leaf.grad = torch_scaled_upcast(g, coef)
        opt.step()

    def triton_side() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return [p.clone() for p in params], [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]

    def triton_step(ps, ms, vs, step=1.0) -> None:
        for p, g, m, v in zip(ps, grads, ms, vs):
            kernels.adamw_step(p, g, m, v, coef, lr=hyper["lr"], beta1=0.9, beta2=0.95, eps=hyper["eps"],
                               weight_decay=hyper["weight_decay"], step=step)

    leaves, opt = torch_side()
    torch_step(leaves, opt)
    ps, ms, vs = triton_side()
    triton_step(ps, ms, vs)
    err = max(float((a.detach() - b).abs().max()) for a, b in zip(leaves, ps))
    scale = max(float(p.abs().max()) for p in params)
    tolerance = scale * 2.0 ** -22  # 2 fp32 ulps of the largest parameter: the update's own rounding, no bf16
    results = {"tensors": len(params), "max_err_vs_fused": err, "tolerance": tolerance, "passed": err <= tolerance}
    del ps, ms, vs
    results["eager_ms"] = round(gpu_ms(lambda: torch_step(leaves, opt)), 3)
    del leaves, opt
    ps, ms, vs = triton_side()
    results["triton_ms"] = round(gpu_ms(lambda: triton_step(ps, ms, vs)), 3)
    return {"kernel": "adamw (every 1b parameter: gradient pass + fused AdamW, against adamw_step on bf16)", **results}


def main() -> int:
    ok = True
    for check in (check_loss, check_swiglu, check_grad_upcast, check_adamw):
        line = {"figure": "kernel_check", **check()}
        ok &= line["passed"]
        print(json.dumps(line), flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
