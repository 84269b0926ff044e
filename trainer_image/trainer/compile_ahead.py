"""Compile a run's Triton kernels (``trainer/kernels.py``) in a process of their own while the worker starts.

Triton compiles a kernel at its first call, for the dtypes and integer classes it is called with, and keeps it in an
on-disk cache (``$TRITON_CACHE_DIR``, by default ``~/.triton/cache``) that a fresh container has empty. Compiled in
the worker, the kernels of ``train.kernels`` and ``optim.implementation`` make a new ``1b`` run's first step seconds
longer on an H200: CPU work of one process that nothing else needs while the worker spends its first seconds
importing, making its CUDA context and building the model.

``python -m trainer.compile_ahead <the trainer's arguments>`` works out which kernels the run will call, with which
dtypes and integers (the same choices as the worker: ``parallel.triton_kernels``, ``optimizer.adamw_implementation``,
the model's sizes from a model on the meta device, the world size from ``WORLD_SIZE``) and compiles each
(``kernels.compile_ahead``: no launch, no device memory) into the on-disk cache, in the order a step first calls
them, each kernel's launcher right after it. It makes no CUDA context (the compile target comes from NVML), so a GPU
in exclusive-process mode is left to the worker. Nothing waits for it: a kernel the worker reaches first, the
worker compiles itself, as before (Triton's cache writes are atomic). It logs one line (what it compiled, in how
long and where the time went, or why not; nothing for arguments the worker itself rejects) and always exits 0.

Who starts it, once per node: ``entrypoint.sh``, before ``ft_launcher`` (whose own start-up is then a head start:
started by the worker, the compile can finish only during the worker's first step; started here, it finishes before
the first step begins), and it exports ``TRAINER_COMPILE_AHEAD=started`` so no worker starts
another. Without the entrypoint (``torchrun -m trainer``) the worker of local rank 0 starts it right after parsing its
arguments, in its first attempt only (a restarted worker finds the cache filled). Off with
``TRAINER_COMPILE_AHEAD=0``; never on a machine without an NVIDIA device, nor for ``train.device=cpu``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

ENV = "TRAINER_COMPILE_AHEAD"


def uses_triton(cfg) -> bool:  # noqa: ANN001 - a JobConfig (trainer.config), without importing torch here
    """Whether the run of ``cfg`` may call the Triton kernels at all (a GPU run whose kernels or AdamW may be them)."""
    if cfg.train.device == "cpu":
        return False
    return cfg.train.kernels != "torch" or cfg.optim.implementation in ("auto", "triton")


def wanted(cfg) -> bool:  # noqa: ANN001
    """Whether this worker should start the compiling process: the run may use the Triton kernels, on a machine with
    an NVIDIA device, from local rank 0 only (one per node), in the first attempt only, unless the entrypoint
    started it already (``TRAINER_COMPILE_AHEAD=started``) or it is off (``TRAINER_COMPILE_AHEAD=0``)."""
    if os.environ.get(ENV, "1") in ("0", "started") or not uses_triton(cfg):
        return False
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
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


def _launcher(kernel) -> int:  # noqa: ANN001 - Triton's CompiledKernel
    """Build the kernel's host-side launcher too (Triton compiles one per signature, with the C compiler, at the
    kernel's first launch, and caches it on disk beside the kernels): no CUDA context needed. 1 if built."""
    from triton.runtime import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - this Triton's launcher is made differently: the worker makes it
        return 0
    return 1


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    try:
        from trainer.config import parse_args

        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # the worker reports bad arguments
            try:
                _, cfg = parse_args(argv)
            except (SystemExit, ValueError):
                return 0
        if not uses_triton(cfg):
            return 0
        details = plan(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if not details["which"] and details["adamw_coef"] is None:
            return 0
        planned = time.perf_counter()
        _target_without_a_context()  # no NVML: nothing compiled ahead (never a CUDA context beside the worker's)
        from trainer import kernels

        compiled = launchers = 0
        for kernel in kernels.compile_ahead(**details):
            compiled += 1
            launchers += _launcher(kernel)
        done = time.perf_counter()
        print(f"trainer.compile_ahead: {compiled} Triton kernel(s) and {launchers} launcher(s) compiled or found in "
              f"the cache in {done - started:.2f} s (imports and plan {planned - started:.2f} s, compile "
              f"{done - planned:.2f} s; "
              f"{', '.join(sorted(details['which']))}{', adamw' if details['adamw_coef'] is not None else ''})",
              file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - an optimisation: the worker compiles what it needs itself
        print(f"trainer.compile_ahead: nothing compiled ahead ({type(exc).__name__}: {exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
