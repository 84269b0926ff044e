"""A new GPU worker's warm-up thread (trainer/warmstart.py): what it runs and when it is skipped.

Its effect on the first step is measured on the GPU (BENCHMARKS.md, "First step of a new worker"); here, on CPU, the
parts that decide what runs: the bare one-block configuration, the integer classes of the optimizer's kernel, the
model and optimizer passes (no RNG stream of the run drawn from), the skip rules, and the thread's report."""

from __future__ import annotations

import pytest
import torch

from trainer import startup, warmstart
from trainer.config import load_config


def test_bare_config_keeps_every_shape_of_the_run_but_the_depth():
    cfg = load_config("1b", ["--data.path=d", "--model.from_hf=/models/x"])
    bare = warmstart.bare_config(cfg)
    assert (bare.model.dim, bare.model.n_heads, bare.model.n_kv_heads, bare.model.ffn_dim, bare.model.vocab_size,
            bare.data.seq_len, bare.train.batch_size) == (cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads,
                                                          cfg.model.ffn_dim, cfg.model.vocab_size, cfg.data.seq_len,
                                                          cfg.train.batch_size)
    assert (bare.model.n_layers, bare.model.from_hf, cfg.model.n_layers, cfg.model.from_hf) == (1, "", 16, "/models/x")
    # 1b: 4 x 4096 tokens, vocabulary 128256: the logits dominate (8 bytes an entry: an fp32 loss's share)
    assert 20 * 2**30 < warmstart.estimate_bytes(bare) < 24 * 2**30


def test_integer_classes_stand_in_for_each_specialisation_of_the_run_sizes():
    assert warmstart.integer_classes([2048 * 8192, 2048, 1]) == [1, 4096]
    assert warmstart.integer_classes([4097, 30]) == [4095]  # neither 1 nor a multiple of 16
    assert warmstart.integer_classes([2**31 + 16]) == []  # 64-bit: left to the run


def test_model_and_optimizer_passes_run_the_trainers_code_and_draw_from_no_rng():
    cfg = load_config("tiny", ["--data.path=d", "--train.device=cpu", "--model.vocab_size=512", "--data.seq_len=32",
                               "--train.batch_size=2"])
    torch.manual_seed(7)
    before = torch.get_rng_state()
    triton = warmstart._model_pass(warmstart.bare_config(cfg), torch.device("cpu"))
    line = warmstart._optimizer_pass(cfg, torch.device("cpu"), 1, triton)
    assert triton == frozenset()  # no Triton kernel on the CPU
    assert line == "for_loop on 1 size class(es)", line
    assert torch.equal(torch.get_rng_state(), before)


def test_the_thread_runs_on_the_workers_device_and_reports_a_failure_as_one_line(monkeypatch):
    cfg = load_config("tiny", ["--data.path=d"])
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)  # no GPU here: the thread's device is recorded
    monkeypatch.setattr(warmstart, "warm_kernels", lambda cfg, device, world_size: f"warmed on {device}")
    assert warmstart.Warmup(cfg, torch.device("cuda", 1), 1).wait() == "warmed on cuda:1"
    assert current == [torch.device("cuda", 1)]

    def broken(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB\nmore")

    monkeypatch.setattr(warmstart, "warm_kernels", broken)
    assert warmstart.Warmup(cfg, torch.device("cuda", 0), 1).wait() == (
        "failed (OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB); the first step loads what it "
        "needs itself")


@pytest.mark.parametrize("flags, prewarmed, device, runs", [
    ([], False, "cuda", True),
    (["--resiliency.start_warmup=false"], False, "cuda", False),
    (["--train.compile=true"], False, "cuda", False),  # Inductor's kernels: its cache serves them
    ([], True, "cuda", False),  # a standby's worker: trainer/prewarm.py warmed it
    ([], False, "cpu", False),
])
def test_start_runs_for_a_new_eager_gpu_worker_only(monkeypatch, flags, prewarmed, device, runs):
    cfg = load_config("1b", ["--data.path=d", "--train.compile=false", *flags])
    monkeypatch.setattr(startup, "PREWARMED", prewarmed)
    monkeypatch.setattr(warmstart, "Warmup", lambda *args: "started")
    assert (warmstart.start(cfg, torch.device(device), 1) == "started") is runs


def test_skipped_when_the_device_lacks_twice_its_memory(monkeypatch):
    cfg = load_config("1b", ["--data.path=d", "--train.compile=false"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 2**30, 141 * 2**30))
    line = warmstart.warm_kernels(cfg, torch.device("cuda", 0), 1)
    assert line == "skipped: 20.0 GiB free on cuda:0, the warm-up needs 22.0 GiB (twice that free)", line


@pytest.mark.parametrize("world_size, coef", [(1, True), (2, False)])
def test_the_triton_adamw_is_warmed_as_the_run_calls_it(monkeypatch, world_size, coef):
    """One rank: OneRank hands it the compute-dtype gradients with clipping's coefficient; FSDP2: fp32 gradients,
    clipped already (no coefficient). Triton is not on this machine: a stand-in records the calls."""
    import sys
    import types

    calls = []
    fake = types.ModuleType("trainer.kernels")
    fake.adamw_step = lambda param, grad, m, v, c, **kw: calls.append((param.numel(), grad.dtype, c is not None))
    monkeypatch.setitem(sys.modules, "trainer.kernels", fake)
    monkeypatch.setattr(warmstart, "adamw_implementation", lambda *args, **kw: "triton")
    cfg = load_config("tiny", ["--data.path=d", "--train.device=cpu", "--optim.grad_clip=1.0", "--model.vocab_size=512"])
    line = warmstart._optimizer_pass(cfg, torch.device("cpu"), world_size, frozenset())
    assert line == "triton on 1 size class(es)"
    assert calls == [(4096, torch.float32, coef)]
