"""On the GPU machine: does the warm-up's compile stage (``trainer/startup/warmup.py``) compile exactly what a run's
worker then calls?

    source bench/gpu_env.sh && python bench/compile_ahead_check.py [DATA]

With an empty Triton cache (a temporary ``TRITON_CACHE_DIR``), runs ``python -m trainer.startup.warmup`` for ``1b``
eager at one rank (every kernel of ``trainer/kernels.py``: the loss, SwiGLU, the Triton AdamW), then calls each
kernel in this process through the trainer's own launchers with the run's dtypes and integers (the loss over
128,256 columns, SwiGLU over batch x sequence x FFN-width elements, AdamW on a parameter of 1b's integer class),
timing each first call. ``passed``: the real calls added nothing to the cache (every kernel and launcher was found
there). Then the same first calls in a fresh process with a second empty cache: what the worker's first step paid.
Prints JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def files(directory: str) -> int:
    return sum(len(names) for _, _, names in os.walk(directory))


def first_calls() -> dict[str, float]:
    """Each kernel's first call with the ``1b`` run's dtypes and integers, ms (compile or cache load, and the run)."""
    import torch
    from kernels_check import FFN, TOKENS, VOCAB  # the 1b run's sizes (this directory is on sys.path)

    from trainer import kernels

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    timings = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        timings[name] = round((time.perf_counter() - started) * 1e3, 1)

    logits = torch.randn(16, VOCAB, device=dev, dtype=bf16)
    targets = torch.randint(0, VOCAB, (16,), device=dev)
    lse = {}
    timed("ce_forward", lambda: lse.setdefault("v", kernels.cross_entropy_forward(logits, targets)[1]))
    timed("ce_backward", lambda: kernels.cross_entropy_backward(logits, targets, lse["v"], torch.ones(1, device=dev)))
    a = torch.randn(TOKENS, FFN, device=dev, dtype=bf16, requires_grad=True)
    b = torch.randn(TOKENS, FFN, device=dev, dtype=bf16, requires_grad=True)
    out = {}
    timed("swiglu_forward", lambda: out.setdefault("v", kernels.swiglu(a, b)))
    timed("swiglu_backward", lambda: out["v"].backward(torch.ones_like(out["v"])))
    param = torch.randn(2048, 2048, device=dev)
    timed("adamw", lambda: kernels.adamw_step(param, param.bfloat16(), torch.zeros_like(param), torch.zeros_like(param),
                                              torch.ones(1, device=dev), lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                              weight_decay=0.1, step=1.0))
    return timings


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--first-calls":  # the child of the cold-cache comparison
        print(json.dumps(first_calls()))
        return 0
    data = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / ".benchdata" / "data")
    warm, cold = tempfile.mkdtemp(prefix="triton-ahead-"), tempfile.mkdtemp(prefix="triton-cold-")
    env = {**os.environ, "TRITON_CACHE_DIR": warm, "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    started = time.perf_counter()
    ahead = subprocess.run([sys.executable, "-m", "trainer.startup.warmup", "--config", "1b", f"--data.path={data}",
                            "--train.compile=false"], env=env, capture_output=True, text=True, timeout=300)
    ahead_s = time.perf_counter() - started
    files_ahead = files(warm)
    os.environ["TRITON_CACHE_DIR"] = warm  # before this process imports Triton
    timings = first_calls()
    files_after = files(warm)
    cold_run = subprocess.run([sys.executable, __file__, "--first-calls"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "TRITON_CACHE_DIR": cold})
    cold_timings = (json.loads(cold_run.stdout.strip().splitlines()[-1]) if cold_run.returncode == 0
                    else cold_run.stderr[-500:])
    print(json.dumps({"figure": "compile_ahead_check", "process_s": round(ahead_s, 2), "rc": ahead.returncode,
                      "line": ahead.stderr.strip().splitlines()[-1] if ahead.stderr.strip() else "",
                      "cache_files_ahead": files_ahead, "cache_files_after_first_calls": files_after,
                      "first_calls_ms_after_ahead": timings, "first_calls_ms_cold_cache": cold_timings,
                      "passed": files_after == files_ahead and files_ahead > 0}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
