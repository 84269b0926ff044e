"""``resiliency.start_warmup``: a new GPU worker loads its first step's kernels in a background thread while it starts.

A new process pays on its first training step for what CUDA and PyTorch load lazily: each kernel's module
(``CUDA_MODULE_LOADING=LAZY``), cuBLAS and cuBLASLt handles and their heuristics for each GEMM shape, flash
attention's kernels, the Triton kernels of ``trainer/kernels.py`` (from Triton's cache on disk, filled by
``trainer/compile_ahead.py``: the binary, its launcher, the first launch), autograd's device threads. On an H200 a
new ``1b`` eager worker's first step takes several times as long as the next ones, unlike the first step of a warm
standby's worker that has run ``trainer/prewarm.py``.

``Warmup`` starts once the worker's device is chosen (``cli``, after ``Resources.create``) and runs beside the rest
of its start (recovery layers, in-process Wrapper, process group, model build, restore), on the same device:

- a bare copy of the model with one block (``model.n_layers`` 1) at the run's shapes: batch, sequence, vocabulary,
  the compute dtype, the eager kernels of ``[train]`` (``parallel.set_kernels``: the RoPE kernel, the Triton
  SwiGLU and loss); one forward and backward, the gradients' norms (``torch._foreach_norm``, as clipping does);
- the optimizer's kernel (``optim.implementation`` resolved: the Triton AdamW with or without clipping's
  coefficient, or the fused / foreach CUDA one), and OneRank's gradient upcast when it runs, on a few elements of
  each integer class the run's parameters fall in (Triton specialises an integer on being 1, a multiple of 16, or
  64-bit; a 64-bit one is left to the run);
- then everything freed and the allocator's cache emptied. It needs no process group, draws nothing from any RNG
  (the bare model is built on the meta device and filled by ``init_weights``'s own generator), and touches no
  parameter, optimizer state or data position of the run.

``train()`` waits for it (phase ``warm`` of the start's log line) before the first step: what it did not finish by
then the start pays, never the first step. On one H200 (``1b`` eager; BENCHMARKS.md, "First step of a new worker")
the first step costs like the others with it, and the start as a whole is as long as without: beside the thread the
main thread's process group and recovery layers take longer (likely the GIL: Triton's first calls are Python) and
its model build shorter. What it buys is a first step that costs like the others.

``start`` decides whether it runs: not for a compiled run (Inductor's kernels are the run's; its cache on disk
serves them), on the CPU, or in a standby's worker (``trainer/prewarm.py`` warmed it); ``warm_kernels`` skips it,
with a reason, when the device has less than twice its estimated memory free (``too_little_memory``, the rule
``trainer/prewarm.py`` follows too). An in-process restart never runs it (its process is warm).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import torch
from torch import nn

from trainer import parallel, startup
from trainer.config import JobConfig
from trainer.model import Transformer, count_params
from trainer.optimizer import ADAMW_OPTIONS, adamw_implementation
from trainer.resiliency import device as device_handover

PREDECESSOR_WAIT_S = 30.0
"""How long the warm-up waits for its memory while a dead predecessor's is released; then it is skipped."""
BYTES_PER_PARAM = 8
"""A bare parameter: fp32, its compute-dtype copy and that copy's gradient (no optimizer state)."""


def bare_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` with one block: every other shape of the run (batch, sequence, vocabulary, widths) kept."""
    bare = copy.deepcopy(cfg)
    bare.model.n_layers = min(cfg.model.n_layers, 1)
    bare.model.from_hf = ""
    return bare


def estimate_bytes(cfg: JobConfig, bytes_per_param: int = BYTES_PER_PARAM) -> int:
    """Device memory one forward and backward of ``cfg``'s model needs, roughly: its parameters at
    ``bytes_per_param`` and one batch's activations, the logits' included (also ``trainer/prewarm.py``'s)."""
    tokens = cfg.train.batch_size * cfg.data.seq_len
    return count_params(cfg.model)["total"] * bytes_per_param + tokens * (cfg.model.vocab_size * 8 + cfg.model.dim * 64)


def too_little_memory(need: int, device: torch.device) -> str | None:
    """Why a warm-up needing ``need`` bytes is skipped on ``device``: less than twice that free (it runs beside a
    worker, or beside this one's model build); None when it fits."""
    free, _ = torch.cuda.mem_get_info(device)
    if free >= 2 * need:
        return None
    return (f"skipped: {free / 2**30:.1f} GiB free on {device}, the warm-up needs {need / 2**30:.1f} GiB "
            "(twice that free)")


def integer_classes(numels: list[int]) -> list[int]:
    """A few-element stand-in for each class of Triton's integer specialisation among ``numels`` (1, a multiple of
    16, neither); 64-bit sizes have none (left to the run)."""
    stand_in = {(True, False): 1, (False, True): 4096, (False, False): 4095}
    return sorted({stand_in[(n == 1, n % 16 == 0 and n != 1)] for n in numels if n < 2**31})


def warm_kernels(cfg: JobConfig, device: torch.device, world_size: int) -> str:
    """The warm-up (see the module's docstring) of an eager run on the CUDA ``device``, the current device of the
    calling thread; returns a line for the log: what ran and how long it took, or why it was skipped."""
    bare = bare_config(cfg)
    _wait_for_predecessor(2 * estimate_bytes(bare), device)
    skipped = too_little_memory(estimate_bytes(bare), device)
    if skipped:
        return skipped
    started = time.perf_counter()
    try:
        triton = _model_pass(bare, device)
        optimizer = _optimizer_pass(cfg, device, world_size, triton)
        torch.cuda.synchronize(device)
    finally:
        torch.cuda.empty_cache()
    kernels = ", ".join(sorted(triton)) or "none"
    return (f"warmed on {device} in {time.perf_counter() - started:.2f} s (one block at the run's shapes: "
            f"{bare.train.batch_size} x {bare.data.seq_len} tokens, vocabulary {bare.model.vocab_size}; Triton "
            f"kernels: {kernels}; optimizer: {optimizer})")


def _wait_for_predecessor(need: int, device: torch.device) -> None:
    """Where this rank's previous worker recorded its memory (it died, and the kernel may still be releasing what it
    held: ``trainer/resiliency/device.py``), wait up to ``PREDECESSOR_WAIT_S`` for ``need`` bytes free; the start's
    own wait for the whole need comes before the model's build, beside this."""
    record = device_handover.NeedRecord.from_environ(device.index or 0)
    if record is None or record.read() <= 0:
        return
    with contextlib.suppress(device_handover.DeviceHeld):
        device_handover.wait_for_memory(need, lambda: int(torch.cuda.mem_get_info(device)[0]),
                                        bound_s=PREDECESSOR_WAIT_S, label=str(device), why="the start's warm-up")


def _model_pass(bare: JobConfig, device: torch.device) -> frozenset[str]:
    """One forward and backward of ``bare``'s model in the compute dtype, the gradients' norms; returns the Triton
    kernels it ran (``parallel.triton_kernels``)."""
    with torch.device("meta"):
        model = Transformer(bare.model, max_seq_len=bare.data.seq_len)
    model.to_empty(device=device)
    model.init_weights(bare.train.seed)  # its own generator: no RNG stream of the run is drawn from
    dtype = parallel.mixed_precision(bare.train, device).param_dtype or torch.float32
    for module in model.modules():  # what OneRank / FSDP2 hand the forward: compute-dtype parameters
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.detach().to(dtype))
    triton = parallel.set_kernels(model, bare.train, device)
    tokens = torch.zeros((bare.train.batch_size, bare.data.seq_len), dtype=torch.long, device=device)
    with torch.enable_grad():
        model(tokens, tokens).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return triton


def _optimizer_pass(cfg: JobConfig, device: torch.device, world_size: int, triton: frozenset[str]) -> str:
    """The optimizer's kernel (and OneRank's upcast where it runs) on stand-ins of the run's integer classes."""
    one_rank = parallel.one_rank_direct(cfg.train, world_size)
    name = adamw_implementation(cfg.optim, device, one_rank=one_rank)
    dtype = parallel.mixed_precision(cfg.train, device).param_dtype or torch.float32
    with torch.device("meta"):
        numels = [p.numel() for p in Transformer(cfg.model, max_seq_len=cfg.data.seq_len).parameters()]
    coef = torch.ones(1, device=device) if cfg.optim.grad_clip > 0 else None
    for n in integer_classes(numels):
        param, grad = torch.zeros(n, device=device), torch.zeros(n, device=device, dtype=dtype)
        if name == "triton":  # with one rank it reads OneRank's compute-dtype gradients with clipping's coefficient;
            from trainer import kernels  # with FSDP2, the fp32 gradients (clipped already)

            kernels.adamw_step(param, grad if one_rank else grad.float(), torch.zeros_like(param),
                               torch.zeros_like(param), coef if one_rank else None, lr=1e-4, beta1=0.9, beta2=0.95,
                               eps=1e-8, weight_decay=0.1, step=1.0)
            continue
        if "grad_upcast" in triton and one_rank:
            from trainer import kernels

            kernels.scaled_upcast(grad, torch.ones(1, device=device))
        param.grad = grad.float()
        torch.optim.AdamW([param], lr=1e-4, **ADAMW_OPTIONS[name]).step()
    return f"{name} on {len(integer_classes(numels))} size class(es)"


class Warmup:
    """``warm_kernels`` in a daemon thread on ``device``; ``wait()`` joins it and returns its line."""

    def __init__(self, cfg: JobConfig, device: torch.device, world_size: int) -> None:
        self.line = ""
        self.thread = threading.Thread(target=self._run, args=(cfg, device, world_size), name="start-warmup",
                                       daemon=True)
        self.thread.start()

    def _run(self, cfg: JobConfig, device: torch.device, world_size: int) -> None:
        try:
            torch.cuda.set_device(device)  # this thread's current device (Triton launches on it)
            self.line = warm_kernels(cfg, device, world_size)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the first step loads what it needs itself
            self.line = f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the first " \
                        "step loads what it needs itself"

    def wait(self) -> str:
        self.thread.join()
        return self.line


def start(cfg: JobConfig, device: torch.device, world_size: int) -> Warmup | None:
    """A ``Warmup`` for this new process, or None where it is off or has nothing to do (see the module's docstring)."""
    if not cfg.resiliency.start_warmup or device.type != "cuda" or cfg.train.compile or startup.PREWARMED:
        return None
    return Warmup(cfg, device, world_size)
