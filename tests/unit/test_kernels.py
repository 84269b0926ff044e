"""Issue 21's kernels against plain references: the chunked cross-entropy that writes its gradient over the logits,
and the real-valued RoPE that ``torch.compile`` uses."""

import pytest
import torch
import torch.nn.functional as F

from trainer import loss as loss_mod
from trainer.loss import ChunkedCrossEntropy, row_chunks
from trainer.model import apply_rope, rope_tables


def _reference(logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0):
    leaf = logits.detach().clone().requires_grad_()
    value = F.cross_entropy(leaf.flatten(0, 1).float(), targets.flatten())
    (value * scale).backward()
    return value.detach(), leaf.grad


def _chunked(logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0, compiled: bool = False):
    """(loss, gradient, whether the gradient lives in the logits' buffer)."""
    leaf = logits.detach().clone().requires_grad_()
    out = leaf * 1  # the loss consumes a non-leaf, as the model's output projection gives it
    buffer = out.data_ptr()
    grads = {}
    out.register_hook(lambda g: grads.setdefault("g", g))
    value = ChunkedCrossEntropy(compiled)(out, targets)
    (value * scale).backward()
    return value.detach(), grads["g"], grads["g"].data_ptr() == buffer


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 3 * 50 * 4)  # 50-column rows: 3 rows per chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_and_gradient_match_cross_entropy(small_chunks, dtype):
    logits = (torch.randn(2, 7, 50) * 3).to(dtype)
    targets = torch.randint(0, 50, (2, 7))
    assert len(row_chunks(14, 50)) == 5
    ref_value, ref_grad = _reference(logits, targets, scale=3.0)
    value, grad, in_place = _chunked(logits, targets, scale=3.0)
    assert in_place, "the gradient must be written over the logits, not into a new buffer"
    assert value.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(value, ref_value, rtol=1e-6, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    else:  # one rounding of the fp32 gradient to bf16 either way: at most one bf16 step apart
        step = ref_grad.float().abs() * 2**-7 + 1e-12
        assert ((grad.float() - ref_grad.float()).abs() <= step).all()


def test_row_chunks_cover_every_row_in_near_equal_pieces():
    chunks = row_chunks(16384, 128256)
    assert len(chunks) == 8 and {b - a for a, b in chunks} == {2048}
    chunks = row_chunks(10, 3, chunk_bytes=3 * 3 * 4)
    assert chunks[0][0] == 0 and chunks[-1][1] == 10 and all(a < b for a, b in chunks)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(chunks, chunks[1:]))
    assert {b - a for a, b in chunks} <= {2, 3}
    assert row_chunks(1, 10**9) == [(0, 1)]


def test_model_loss_is_chunked_and_equals_the_plain_one():
    from trainer.config import ModelConfig
    from trainer.model import Transformer, cross_entropy

    cfg = ModelConfig(name="micro", dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    tokens = torch.randint(0, 64, (2, 9))
    grads = []
    for fn in (cross_entropy, ChunkedCrossEntropy()):
        model = Transformer(cfg, max_seq_len=8)
        model.init_weights(0)
        model.loss_fn = fn
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_real_rope_is_the_complex_one():
    tables = rope_tables(8, 12, 500000.0)
    x = torch.randn(2, 12, 3, 8)
    torch.testing.assert_close(apply_rope(x, tables, "real"), apply_rope(x, tables, "complex"), rtol=1e-6, atol=1e-6)
    xb = x.bfloat16()
    assert apply_rope(xb, tables, "real").dtype == torch.bfloat16
    torch.testing.assert_close(apply_rope(xb, tables, "real"), apply_rope(xb, tables, "complex"), rtol=0, atol=0.02)
    assert torch.equal(apply_rope(x, tables), apply_rope(x, tables, "complex"))  # auto: complex


@pytest.mark.slow
def test_compiled_chunk_kernels_match_the_eager_ones(small_chunks):
    logits = (torch.randn(2, 6, 50) * 3).bfloat16()
    targets = torch.randint(0, 50, (2, 6))
    eager_value, eager_grad, _ = _chunked(logits, targets)
    value, grad, in_place = _chunked(logits, targets, compiled=True)
    assert in_place
    torch.testing.assert_close(value, eager_value, rtol=1e-6, atol=0)
    step = eager_grad.float().abs() * 2**-7 + 1e-12
    assert ((grad.float() - eager_grad.float()).abs() <= step).all()


def test_auto_rope_is_the_real_kernel_compiled_and_the_complex_one_in_eager_mode():
    from trainer.config import TrainConfig
    from trainer.parallel import rope_kernel

    assert rope_kernel(TrainConfig(compile=True)) == "real"
    assert rope_kernel(TrainConfig(compile=False)) == "complex"
    assert rope_kernel(TrainConfig(compile=True, rope_kernel="complex")) == "complex"
    assert rope_kernel(TrainConfig(compile=False, rope_kernel="real")) == "real"


def test_triton_kernels_only_on_cuda_where_inductor_does_not_fuse_and_a_missing_triton_is_said_when_asked_for(
        monkeypatch):
    """``train.kernels`` (trainer/kernels.py): never on CPU; compiled, the loss and the gradient pass outside the
    graphs, not SwiGLU; ``auto`` falls back to PyTorch's ops without Triton, ``triton`` says what to change."""
    import sys
    import types

    from trainer.config import ConfigError, TrainConfig
    from trainer.parallel import triton_kernels

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails
    assert not triton_kernels(TrainConfig(compile=False), cuda)
    with pytest.raises(ConfigError, match="train.kernels=triton needs Triton .*set train.kernels=auto"):
        triton_kernels(TrainConfig(compile=False, kernels="triton"), cuda)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    every = {"loss", "swiglu", "grad_upcast"}
    assert triton_kernels(TrainConfig(compile=False), cuda) == every
    assert triton_kernels(TrainConfig(compile=False, kernels="triton"), cuda) == every
    assert triton_kernels(TrainConfig(compile=True), cuda) == {"loss", "grad_upcast"}  # no SwiGLU: Inductor fuses it
    assert triton_kernels(TrainConfig(compile=True, kernels="triton"), cuda) == {"loss", "grad_upcast"}
    assert not triton_kernels(TrainConfig(compile=False, kernels="torch"), cuda)
    assert not triton_kernels(TrainConfig(compile=False, kernels="triton"), cpu)
    with pytest.raises(ConfigError, match="train.kernels"):
        TrainConfig(kernels="cuda").validate()
