"""Warm a process's kernels before it is needed: a small copy of the configured model, two steps, thrown away.

A new process pays on its first model build, forward, backward and optimizer step for what CUDA and PyTorch load
lazily: kernels (``CUDA_MODULE_LOADING=LAZY``), cuBLAS and cuBLASLt handles and their heuristics, flash
attention's kernels, autograd's device threads, the fused AdamW kernel. In an in-job restart on an H200 those first
calls took ~6 s of the worker's start (``startup`` phases ``model`` and ``restore`` of a new process, against
0.3 s for the same calls in a warm process).

A warm standby worker (``trainer/standby.py``) runs ``prewarm`` once the job's command line is known (the worker
it will replace wrote it into its first-step marker): the configured model with ``layers`` blocks, a vocabulary
of at most ``vocab_cap``, one sequence of ``tokens`` tokens, built and trained for two steps by the trainer's own
code (``build_model``, ``build_optimizer``) on the rank's device, then freed and the allocator's cache emptied.
What stays is what was loaded, not memory. Nothing compiled: a compiled run's kernels are specific to its shapes
(Inductor's cache on disk serves those).

It needs about ``warmstart.estimate_bytes`` of free device memory, beside the running worker's: it is skipped, with a
reason, when less than twice that is free.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from typing import Iterator

import torch
import torch.distributed as dist

from trainer import parallel, startup
from trainer.config import JobConfig
from trainer.train import build_model, build_optimizer
from trainer.warmstart import estimate_bytes, too_little_memory

LAYERS = 1
TOKENS = 512
VOCAB_CAP = 4096
BYTES_PER_PARAM = 20
"""fp32 parameter, gradient and two AdamW moments, plus the bf16 compute copy and its gradient."""


def small_config(cfg: JobConfig, layers: int = LAYERS, tokens: int = TOKENS, vocab_cap: int = VOCAB_CAP) -> JobConfig:
    """``cfg``'s model and execution choices at a size that costs the device little: ``layers`` blocks, a
    vocabulary of at most ``vocab_cap``, one sequence of ``tokens``; eager (see the module's docstring)."""
    small = copy.deepcopy(cfg)
    small.model.n_layers = min(cfg.model.n_layers, layers)
    small.model.vocab_size = min(cfg.model.vocab_size or vocab_cap, vocab_cap)
    small.model.from_hf = ""
    small.data.seq_len = min(cfg.data.seq_len, tokens)
    small.train.batch_size = 1
    small.train.compile = False
    return small


def prewarm(cfg: JobConfig, device: torch.device, **size: int) -> str:
    """Two training steps of ``small_config(cfg, **size)`` on ``device``, everything freed after; returns a line
    for the log (what ran and how long it took, or why it was skipped)."""
    if device.type != "cuda":
        return "nothing to warm on the CPU"
    small = small_config(cfg, **size)
    skipped = too_little_memory(estimate_bytes(small, BYTES_PER_PARAM), device)
    if skipped:
        return skipped
    started = time.perf_counter()
    one_step(small, device)
    startup.PREWARMED = True
    return (f"warmed on {device} in {time.perf_counter() - started:.2f} s ({small.model.n_layers} block(s), "
            f"vocabulary {small.model.vocab_size}, {small.data.seq_len} tokens)")


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this one rank for the length of the block (the model's sharding asks for one), unless one
    exists already; gone after. Also what the GPU benches use to build the model outside a launcher."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(parallel.backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


def one_step(small: JobConfig, device: torch.device) -> None:
    """Build ``small`` with the trainer's code, train it two steps on dummy tokens, free it all (any device)."""
    try:
        with one_rank_group(device):
            model = build_model(small, device)
            optimizer = build_optimizer(model, small.optim)
            tokens = torch.zeros((1, small.data.seq_len), dtype=torch.long, device=device)
            for _ in range(2):  # the second step's paths differ (the optimizer's state exists)
                model(tokens, tokens).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            del model, optimizer
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
