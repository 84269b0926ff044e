"""The throughput changes of issue 14 that can be checked without a GPU: optimizer kernel choice, the GC policy,
the RoPE and RMSNorm kernels against plain references, the loss computed inside the model call, new config keys."""

import gc
import math

import pytest
import torch
import torch.nn.functional as F

from trainer.config import ConfigError, OptimConfig, load_config
from trainer.model import RMSNorm, Transformer, apply_rope, cross_entropy, rope_tables
from trainer.train import GarbageCollection, adamw_implementation, build_optimizer


def _tiny(vocab=256):
    cfg = load_config("tiny", ["--data.path=/d"]).model
    cfg.vocab_size = vocab
    return cfg


@pytest.mark.parametrize(("setting", "device", "one_rank", "triton", "expected"), [
    ("auto", "cpu", True, True, "for_loop"), ("auto", "cuda", False, True, "fused"),
    ("auto", "cuda", True, True, "triton"), ("auto", "cuda", True, False, "fused"),
    ("foreach", "cuda", True, True, "foreach"), ("for_loop", "cuda", False, True, "for_loop"),
    ("fused", "cpu", False, True, "fused"), ("triton", "cuda", False, True, "triton"),
])
def test_adamw_implementation(setting, device, one_rank, triton, expected, monkeypatch):
    """``auto`` on GPU: the Triton AdamW only with one rank (it reads OneRank's bf16 gradients) and Triton there."""
    from trainer import optimizer
    monkeypatch.setattr(optimizer, "triton_missing", lambda: "" if triton else "No module named 'triton'")
    assert adamw_implementation(OptimConfig(implementation=setting), torch.device(device), one_rank) == expected


def test_cpu_optimizer_keeps_the_per_parameter_loop():
    model = Transformer(_tiny(), max_seq_len=16)
    optimizer = build_optimizer(model, OptimConfig())
    assert optimizer.defaults["foreach"] is False
    assert not optimizer.defaults["fused"]


def test_bad_optimizer_and_train_keys_name_the_key():
    with pytest.raises(ConfigError, match="optim.implementation"):
        load_config("tiny", ["--data.path=/d", "--optim.implementation=apex"])
    with pytest.raises(ConfigError, match="train.reshard_after_forward"):
        load_config("tiny", ["--data.path=/d", "--train.reshard_after_forward=sometimes"])
    with pytest.raises(ConfigError, match="train.gc_every"):
        load_config("tiny", ["--data.path=/d", "--train.gc_every=-1"])


def test_garbage_collection_every_n_steps():
    assert gc.isenabled()
    collected = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collected.append(info["generation"]))
    try:
        with GarbageCollection(3) as collector:
            assert not gc.isenabled()
            collected.clear()
            for step in range(1, 8):
                collector.step(step)
            assert collected == [1, 1]  # steps 3 and 6, young generations only
        assert gc.isenabled()
        with GarbageCollection(0) as collector:
            assert gc.isenabled()
            collected.clear()
            collector.step(50)
            assert collected == []
    finally:
        gc.callbacks.pop()
        gc.enable()


def test_rope_is_the_rotation_of_channel_pairs():
    head_dim, seq, theta = 8, 12, 500000.0
    x = torch.randn(2, seq, 3, head_dim, dtype=torch.float64)
    tables = rope_tables(head_dim, seq, theta)
    out = apply_rope(x.float(), tables).double()
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq  # [seq, head_dim/2]
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    ref = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    assert torch.linalg.norm(out - ref) / torch.linalg.norm(ref) < 1e-6
    # bf16 activations and bf16 tables (a caller that casts them) still rotate in fp32.
    assert apply_rope(x.bfloat16(), tables.bfloat16()).dtype == torch.bfloat16


def test_rmsnorm_matches_the_fp32_formula():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    x = torch.randn(4, 5, 16)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.allclose(norm(x), ref, rtol=1e-5, atol=1e-6)


def test_loss_inside_the_model_call_is_the_cross_entropy_of_its_logits():
    cfg = _tiny()
    model = Transformer(cfg, max_seq_len=16)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logits = model(inputs)
        loss = model(inputs, targets)
    assert torch.equal(loss, cross_entropy(logits, targets))
    assert math.isclose(loss.item(), F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item(), rel_tol=1e-6)
    assert cross_entropy(logits.bfloat16(), targets).dtype == torch.float32


def test_throughput_figure_takes_the_median_of_the_measured_windows(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from figures import throughput_figure

    records = [{"event": "start", "world_size": 2, "model": "1b"}]
    for step, tps in ((5, 1.0), (10, 2.0), (15, 30.0), (20, 10.0), (25, 20.0), (30, 999.0)):
        records.append({"event": "step", "step": step, "loss": 1.0 / step, "tokens_per_s": tps, "step_time_s": 1 / tps,
                        "mfu": None, "mem_reserved_gib": step / 10, "mem_allocated_gib": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = throughput_figure(tmp_path, skip=10, until=25)
    assert (fig["tokens_per_s"], fig["tokens_per_s_per_gpu"], fig["steps_measured"]) == (20, 10, 3)
    assert fig["mem_reserved_gib"] == 2.5 and sorted(fig["losses"]) == [5, 10, 15, 20, 25]
    with pytest.raises(ValueError, match="no step records after step 30"):
        throughput_figure(tmp_path, skip=30)
