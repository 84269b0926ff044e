"""Compile a run's Triton kernels (``trainer/kernels.py``) in a process of their own while the worker starts.

Triton compiles a kernel at its first call, for the dtypes and integer classes it is called with, and keeps it in an
on-disk cache (``$TRITON_CACHE_DIR``, by default ``~/.triton/cache``) that a fresh container has empty. On one H200 a
new ``1b`` eager run's first step took 5.46 s with the kernels of ``train.kernels`` and ``optim.implementation``
compiled in it, against 0.89 s for the same step before them (BENCHMARKS.md, sessions 12-13): 4.6 s of one process's CPU
that nothing else needed at that moment, while the worker spent 9 s importing, making its CUDA context and building
the model.

The worker's local rank 0 starts ``python -m trainer.compile_ahead <its own arguments>`` right after parsing them
(``spawn``). That process works out which kernels the run will call, with which dtypes and integers (the same choices
as the worker: ``parallel.triton_kernels``, ``optimizer.adamw_implementation``, the model's sizes from a model on the
meta device) and compiles each (``kernels.compile_ahead``: no launch, no device memory) into the on-disk cache. It
makes no CUDA context (the compile target comes from NVML), so a GPU in exclusive-process mode is left to the
worker. Nothing waits for it: a kernel the worker reaches first, the worker compiles itself, as before (Triton's
cache writes are atomic). It logs one line (what it compiled, in how long, or why not) and always exits 0.
Off with ``TRAINER_COMPILE_AHEAD=0``; never on a machine without an NVIDIA device, nor for ``train.device=cpu``.

Not run on a GPU yet (session 13's device call for it was lost): whether the worker then finds every kernel in the
cache is what ``bench/compile_ahead_check.py`` checks, and the goodput run's first step shows what it saves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ENV = "TRAINER_COMPILE_AHEAD"


def wanted(cfg) -> bool:  # noqa: ANN001 - a JobConfig (trainer.config), without importing torch here
    """Whether this process should start the compiling process: the run may use the Triton kernels, on a machine
    with an NVIDIA device, from local rank 0 only (one compile per node), unless ``TRAINER_COMPILE_AHEAD=0``."""
    if os.environ.get(ENV, "1") == "0" or cfg.train.device == "cpu":
        return False
    if cfg.train.kernels == "torch" and cfg.optim.implementation not in ("auto", "triton"):
        return False
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.path.exists("/dev/nvidiactl")


def spawn(argv: list[str], cfg) -> subprocess.Popen | None:  # noqa: ANN001
    """Start ``python -m trainer.compile_ahead argv`` in the background when ``wanted``; its line goes to stderr.
    Same process group as the worker: a launcher that stops the worker's group stops it too."""
    if not wanted(cfg):
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "trainer.compile_ahead", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
    except OSError:
        return None  # an optimisation only: the worker compiles what it needs itself


def plan(cfg, world_size: int) -> dict:  # noqa: ANN001
    """What the worker of ``cfg`` at ``world_size`` ranks will compile: ``kernels.compile_ahead``'s arguments."""
    import torch

    from trainer import parallel
    from trainer.model import Transformer
    from trainer.optimizer import adamw_implementation

    resolve_shape(cfg)
    cuda = torch.device("cuda")
    which = set(parallel.triton_kernels(cfg.train, cuda))
    one_rank = parallel.one_rank_direct(cfg.train, world_size)
    # with one rank the Triton AdamW reads OneRank's compute-dtype gradients (no gradient pass); with FSDP2 it is
    # not auto's choice, and an explicit one reads fp32 gradients, which this does not plan
    adamw = one_rank and adamw_implementation(cfg.optim, cuda, one_rank=True) == "triton"
    if adamw or not one_rank:
        which.discard("grad_upcast")  # OneRank's gradient pass
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.data.seq_len)
    dtype = parallel.mixed_precision(cfg.train, cuda).param_dtype or torch.float32
    return {"which": frozenset(which), "vocab": cfg.model.vocab_size, "dtype": dtype,
            "activation_numel": cfg.train.batch_size * cfg.data.seq_len * cfg.model.ffn_dim,
            "param_numels": [p.numel() for p in model.parameters()],
            "adamw_coef": (cfg.optim.grad_clip > 0) if adamw else None}


def resolve_shape(cfg) -> None:  # noqa: ANN001
    """The model's shape as the worker will resolve it (``train.Resources``): from ``model.from_hf``'s config.json
    when that is a local directory (nothing is fetched from remote storage twice: ValueError otherwise), a
    vocabulary of 0 from the dataset's manifest."""
    if cfg.model.from_hf:
        if not os.path.isdir(cfg.model.from_hf):
            raise ValueError("model.from_hf is not a local directory")
        from trainer.hf import BaseModel

        BaseModel.for_model(cfg.model, 0)
    if cfg.model.vocab_size == 0:
        from trainer.data import ShardedTokens

        cfg.model.vocab_size = ShardedTokens(cfg.data.path, verify=False).vocab_size  # reads the manifest only


def _target_without_a_context() -> None:
    """Point Triton's compile target at this machine's GPU from NVML, so compiling makes no CUDA context."""
    import pynvml

    pynvml.nvmlInit()
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-"))
              else pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0))
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    active = driver.active
    target = GPUTarget("cuda", major * 10 + minor, 32)
    active.get_current_target = lambda: target
    active.get_current_device = lambda: 0
    active.get_current_stream = lambda device=None: 0  # asked for before a warm-up returns: no launch uses it


def _launchers(compiled: list) -> int:
    """Build each kernel's host-side launcher too (Triton compiles one per signature, with the C compiler, at the
    kernel's first launch, and caches it on disk beside the kernels): no CUDA context needed."""
    from triton.runtime import driver

    built = 0
    for kernel in compiled:
        try:
            driver.active.launcher_cls(kernel.src, kernel.metadata)
            built += 1
        except Exception:  # noqa: BLE001 - this Triton's launcher is made differently: the worker makes it
            pass
    return built


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    try:
        from trainer.config import parse_args

        _, cfg = parse_args(argv)
        details = plan(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if not details["which"] and details["adamw_coef"] is None:
            return 0
        _target_without_a_context()  # no NVML: nothing compiled ahead (never a CUDA context beside the worker's)
        from trainer import kernels

        compiled = kernels.compile_ahead(**details)
        launchers = _launchers(compiled)
        print(f"trainer.compile_ahead: {len(compiled)} Triton kernel(s) and {launchers} launcher(s) compiled or "
              f"found in the cache in "
              f"{time.perf_counter() - started:.2f} s ({', '.join(sorted(details['which']))}"
              f"{', adamw' if details['adamw_coef'] is not None else ''})", file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - an optimisation: the worker compiles what it needs itself
        print(f"trainer.compile_ahead: nothing compiled ahead ({type(exc).__name__}: {exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
