"""One rank without FSDP2 (``train.single_rank=direct``): the same parameters, gradients and checkpoint layout as
FSDP2 on one rank, bit for bit, in fp32 and in bf16 compute (CPU, one gloo process)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.checkpoint.state import local_tensors
from trainer.config import ConfigError, ModelConfig, OptimConfig, TrainConfig, load_config
from trainer.model import Transformer
from trainer.onerank import is_one_rank
from trainer.parallel import apply_fsdp, clip_grad_norm_
from trainer.train import TrainProgress, build_optimizer

MODEL = ModelConfig(name="micro", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
SEQ = 8


@pytest.fixture
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


CLIP = 0.5  # below the micro model's gradient norms: every step is clipped


def build(single_rank: str, precision: str = "fp32", grad_clip: float = 0.0, **train) -> torch.nn.Module:
    model = Transformer(MODEL, max_seq_len=SEQ)
    model.init_weights(0)
    cfg = TrainConfig(device="cpu", mixed_precision=precision, single_rank=single_rank, **train)
    return apply_fsdp(model, cfg, torch.device("cpu"), grad_clip=grad_clip)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], list[float], dict]:
    optimizer = build_optimizer(model, OptimConfig(implementation="for_loop"))
    losses, norms = [], []
    for step in range(1, steps + 1):
        loss = model(*batch(step))
        loss.backward()
        norm = clip_grad_norm_(model, CLIP)  # the trainer's loop: OneRank built with grad_clip has clipped already
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = {"model": model, "optimizer": optimizer, "progress": TrainProgress(), "dataloader": None}
    return losses, norms, state


@pytest.mark.parametrize("grad_clip", [CLIP, 0.0], ids=["clipped-while-converting", "clipped-after"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_direct_equals_fsdp_bit_for_bit(pg, precision, grad_clip):
    direct, fsdp = build("direct", precision, grad_clip), build("fsdp", precision, grad_clip)
    assert is_one_rank(direct) and not is_one_rank(fsdp)
    losses_d, norms_d, state_d = train(direct)
    losses_f, norms_f, state_f = train(fsdp)
    assert losses_d == losses_f and norms_d == norms_f
    tensors_d, pieces_d, extra_d = local_tensors(state_d)
    tensors_f, pieces_f, extra_f = local_tensors(state_f)
    assert pieces_d == pieces_f and len(pieces_d) > 20, "the checkpoint layout (names, DTensor pieces) is FSDP2's"
    assert all(p.sharded for p in pieces_d.values() if p.global_shape != ())
    assert extra_d == extra_f
    different = [k for k in tensors_f if not torch.equal(tensors_d[k], tensors_f[k])]
    assert not different, different[:5]


def test_the_backward_ends_with_clipped_fp32_gradients_and_the_norm(pg):
    model = build("direct", "bf16", CLIP)
    model(*batch(1)).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, DTensor) and g.dtype == torch.float32 for g in grads)
    clipped = torch.linalg.vector_norm(torch.stack([g.to_local().norm() for g in grads]))
    norm = clip_grad_norm_(model, CLIP)
    assert float(norm) > 1.0 and float(clipped) == pytest.approx(CLIP, rel=1e-5)
    again = clip_grad_norm_(model, CLIP)  # a second call: the usual clip, of the clipped gradients
    assert float(again.full_tensor()) == pytest.approx(float(clipped), rel=1e-5)


def test_gradients_survive_other_forwards_and_accumulate_unclipped(pg):
    model, reference = build("direct", "bf16", CLIP), build("fsdp", "bf16")
    loss = model(*batch(1))
    with torch.no_grad():
        model(*batch(2))  # an evaluation forward before the backward
    (loss + model(*batch(3))).backward()  # two forwards, one backward: accumulation, no clipping on the way
    (reference(*batch(1)) + reference(*batch(3))).backward()
    assert model._one_rank.last_norm is None and not model._one_rank.pending
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-2, atol=1e-5, msg=name)


def test_parameters_outside_the_forward_are_the_fp32_dtensors(pg):
    model = build("direct", "bf16")
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params.values())
    seen = {}

    def record(module, args, output):
        seen["wq"] = module.wq.weight

    hook = model.layers[0].attention.register_forward_hook(record)
    with torch.no_grad():
        model(batch(1)[0])
    hook.remove()
    assert type(seen["wq"]) is torch.Tensor and seen["wq"].dtype == torch.bfloat16  # bf16 inside the forward
    assert dict(model.named_parameters()) == params  # the masters are back, the same objects

    def boom(module, args):
        raise RuntimeError("boom")

    hook = model.layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(*batch(1))
    hook.remove()
    assert dict(model.named_parameters()) == params  # also after a forward that raised


def test_tied_parameters_are_cast_once_and_get_both_gradients(pg):
    def tied(single_rank: str | None) -> torch.nn.Module:
        model = Transformer(MODEL, max_seq_len=SEQ)
        model.init_weights(0)
        model.output.weight = model.tok_embeddings.weight
        if single_rank is None:
            return model
        cfg = TrainConfig(device="cpu", single_rank=single_rank, chunked_loss=False)  # the plain model's loss
        return apply_fsdp(model, cfg, torch.device("cpu"))

    model, plain = tied("direct"), tied(None)
    assert model.output.weight is model.tok_embeddings.weight
    for m in (model, plain):
        m(*batch(1)).backward()
    assert torch.equal(model.output.weight.grad.full_tensor(), plain.output.weight.grad)


def test_activation_checkpointing_keeps_fsdp(pg):
    assert not is_one_rank(build("auto", activation_checkpointing=True))
    assert is_one_rank(build("auto"))
    with pytest.raises(ConfigError, match="train.single_rank=direct cannot recompute"):
        load_config("tiny", ["--data.path=/d", "--train.single_rank=direct", "--train.activation_checkpointing=true"])
    with pytest.raises(ConfigError, match="train.single_rank must be one of"):
        load_config("tiny", ["--data.path=/d", "--train.single_rank=never"])


@pytest.mark.slow
def test_compiled_blocks_take_the_casts_as_inputs_without_recompiling(pg):
    """``torch.compile`` per block sees new bf16 tensors every step: they must be graph inputs, not constants."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = build("direct", "bf16", CLIP, compile=True)  # blocks, norm and the chunked loss compiled; RoPE real
    optimizer = build_optimizer(model, OptimConfig(implementation="for_loop"))
    losses = []
    for step in range(1, 4):
        loss = model(*batch(step))
        loss.backward()
        clip_grad_norm_(model, CLIP)  # as train() does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a block was recompiled after the first step"
    eager, _, _ = train(build("direct", "bf16", CLIP))
    assert losses != eager, "compiled code ran"
    assert losses == pytest.approx(eager, rel=2e-2), "the compiled model computes what the eager one does"


def test_the_chosen_triton_kernels_are_the_ones_the_step_calls(pg, monkeypatch):
    """``train.kernels`` wiring (``parallel.apply_fsdp``): with the kernels chosen, SwiGLU, the loss's two kernels
    (one chunk) and one rank's gradient pass go through ``trainer/kernels.py``, and the step's loss and gradients
    are what PyTorch's ops give. Triton is not needed here: its module is replaced by these PyTorch versions."""
    import collections
    import sys
    import types

    import torch.nn.functional as F

    import trainer
    from trainer import loss as loss_mod
    from trainer import parallel

    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    fake = types.ModuleType("trainer.kernels")
    fake.swiglu = counted("swiglu", lambda a, b: F.silu(a) * b)
    fake.cross_entropy_forward = counted("loss_forward", loss_mod.eager_forward)
    fake.cross_entropy_backward = counted("loss_backward", loss_mod.eager_backward)
    fake.scaled_upcast = counted("grad_upcast",
                                 lambda g, c: torch.mul(g, c, out=torch.empty_like(g, dtype=torch.float32)))
    monkeypatch.setitem(sys.modules, "trainer.kernels", fake)
    monkeypatch.setattr(trainer, "kernels", fake, raising=False)

    def run(chosen: frozenset) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(parallel, "triton_kernels", lambda cfg, device: chosen)
        model = build("direct", "bf16", grad_clip=CLIP)
        loss = model(*batch(1))
        loss.backward()
        return loss.detach(), [p.grad.to_local().clone() for p in model.parameters()]

    plain_loss, plain_grads = run(frozenset())
    assert not calls
    loss, grads = run(frozenset({"loss", "swiglu", "grad_upcast"}))
    n_params = len(grads)
    assert calls == {"swiglu": MODEL.n_layers, "loss_forward": 1, "loss_backward": 1, "grad_upcast": n_params}
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_an_optimizer_that_reads_one_ranks_bf16_gradients_steps_as_adamw_bit_for_bit(pg, monkeypatch):
    """``optim.implementation=triton`` with one rank: ``OneRank`` hands its compute-dtype gradients and clipping's
    coefficient to the optimizer (no fp32 gradient is made), a warm-up backward dropped by ``model.zero_grad`` never
    leaks into a step, and the result equals AdamW's per-parameter loop on the converted gradients, bit for bit.
    ``trainer.kernels.adamw_step`` is replaced by that loop's arithmetic in PyTorch ops (no Triton here)."""
    import sys
    import types

    import trainer
    from trainer import train as train_mod

    steps_taken: list[torch.dtype] = []

    def adamw_step(param, grad, exp_avg, exp_avg_sq, coef, *, lr, beta1, beta2, eps, weight_decay, step):
        steps_taken.append(grad.dtype)
        g = grad.float() if coef is None else torch.mul(grad, coef, out=torch.empty_like(grad, dtype=torch.float32))
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1 ** step)))

    fake = types.ModuleType("trainer.kernels")
    fake.adamw_step = adamw_step
    monkeypatch.setitem(sys.modules, "trainer.kernels", fake)
    monkeypatch.setattr(trainer, "kernels", fake, raising=False)

    def run(implementation: str) -> tuple[list[float], dict]:
        model = build("direct", "bf16", grad_clip=CLIP)
        monkeypatch.setattr(train_mod, "adamw_implementation", lambda cfg, device, one_rank=False: implementation)
        optimizer = build_optimizer(model, OptimConfig(implementation=implementation, weight_decay=0.1))
        model(*batch(99)).backward()  # a warm-up's backward, then dropped (trainer.train.warm_up_step)
        model.zero_grad(set_to_none=True)
        losses = []
        for step in range(1, 4):
            loss = model(*batch(step))
            loss.backward()
            clip_grad_norm_(model, CLIP)
            if implementation == "triton":
                assert all(p.grad is None for p in model.parameters())  # handed over, not converted
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, {"model": [p.to_local().clone() for p in model.parameters()],
                        "optim": optimizer.state_dict()["state"]}

    reference_losses, reference = run("for_loop")
    losses, state = run("triton")
    n_params = len(reference["model"])
    assert steps_taken == [torch.bfloat16] * (3 * n_params)
    assert losses == reference_losses
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(state["model"], reference["model"]))
    for index, entry in reference["optim"].items():
        for key, value in entry.items():
            mine = state["optim"][index][key]
            value, mine = (t.to_local() if isinstance(t, DTensor) else t for t in (value, mine))
            assert torch.equal(mine, value), (index, key)
