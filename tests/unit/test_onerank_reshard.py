"""``OneRank`` resharding (``train.reshard_after_forward``): each block but the last frees its bf16 copies after its
forward and casts them again for its backward; the losses, gradients and parameters are those of keeping them, bit
for bit, in eager and compiled blocks (CPU, one gloo process)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.checkpoint.state import local_tensors
from trainer.config import ModelConfig, OptimConfig, TrainConfig
from trainer.model import Transformer
from trainer.parallel import apply_fsdp, clip_grad_norm_
from trainer.train import TrainProgress, build_optimizer

MODEL = ModelConfig(name="micro", dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
SEQ = 8
CLIP = 0.5  # below the micro model's gradient norms: every step is clipped


@pytest.fixture
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build(reshard: str, precision: str = "bf16", compile: bool = False, tie=None) -> torch.nn.Module:
    model = Transformer(MODEL, max_seq_len=SEQ)
    model.init_weights(0)
    if tie is not None:
        tie(model)
    cfg = TrainConfig(device="cpu", mixed_precision=precision, single_rank="direct", reshard_after_forward=reshard,
                      compile=compile, compile_loss=False)  # compiled: the blocks only (CPU compiles are slow)
    return apply_fsdp(model, cfg, torch.device("cpu"), grad_clip=CLIP)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def copies_by_block(model: torch.nn.Module) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The copies of the last forward with grad whose backward has not run: per block, and outside the blocks
    (by the first name that holds each)."""
    one = model._one_rank
    copies = one.pending[-1]
    names = {id(m): n for n, m in model.named_modules()}
    blocks: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]
    rest: dict[str, torch.Tensor] = {}
    where = {id(m): b for b, layer in enumerate(model.layers) for m in layer.modules()}
    for owner, name, i in one.slots:
        target = blocks[where[id(owner)]] if id(owner) in where else rest
        target.setdefault(f"{names[id(owner)]}.{name}", copies[i])
    return blocks, rest


def freed(tensors: dict[str, torch.Tensor]) -> set[str]:
    return {name for name, t in tensors.items() if t.untyped_storage().size() == 0}


def train(model: torch.nn.Module, steps: int = 3, between=None) -> tuple[list[float], list[float], dict]:
    """The trainer's loop (for_loop AdamW, clipping); ``between(model, step)`` runs after each forward."""
    optimizer = build_optimizer(model, OptimConfig(implementation="for_loop"))
    losses, norms = [], []
    for step in range(1, steps + 1):
        loss = model(*batch(step))
        if between is not None:
            between(model, step)
        loss.backward()
        norm = clip_grad_norm_(model, CLIP)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, {"model": model, "optimizer": optimizer, "progress": TrainProgress(), "dataloader": None}


def assert_same_training(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and a[1] == b[1], "losses and gradient norms"
    tensors_a, _, extra_a = local_tensors(a[2])
    tensors_b, _, extra_b = local_tensors(b[2])
    assert extra_a == extra_b
    different = [k for k in tensors_b if not torch.equal(tensors_a[k], tensors_b[k])]
    assert not different, different[:5]


def check_freed(expected: bool):
    """``between`` for ``train``: after each forward, every non-last block's copies are freed (or none is)."""
    def between(model: torch.nn.Module, step: int) -> None:
        blocks, rest = copies_by_block(model)
        assert not freed(rest) and not freed(blocks[-1]), "outside the blocks and the last block: kept"
        for b, copies in enumerate(blocks[:-1]):
            assert freed(copies) == (set(copies) if expected else set()), (step, b)
    return between


@pytest.mark.parametrize("reshard", ["auto", "always"])
def test_copies_are_freed_after_their_forward_and_cast_again_for_their_backward(pg, reshard):
    on, off = build(reshard), build("never")
    loss_on, loss_off = on(*batch(1)), off(*batch(1))
    (blocks_on, rest_on), (blocks_off, _) = copies_by_block(on), copies_by_block(off)
    for b, copies in enumerate(blocks_on[:-1]):
        assert copies and freed(copies) == set(copies), f"block {b}: every copy's storage freed"
        assert all(t.dtype == torch.bfloat16 and t.requires_grad and t.numel() for t in copies.values())
    assert not freed(blocks_on[-1]) and not freed(rest_on), "the last block and the rest: kept"
    assert not any(freed(copies) for copies in blocks_off), "never: kept"
    held = [t for copies in blocks_on for t in copies.values()]  # finish_gradients drops them; keep them to look
    masters = dict(on.named_parameters())
    assert loss_on.item() == loss_off.item()
    loss_on.backward()
    loss_off.backward()
    assert all(t.untyped_storage().size() == t.numel() * 2 for t in held), "given back for the backward"
    cast = {name: p.to_local().to(torch.bfloat16) for name, p in masters.items()}
    for name, t in [(n, t) for copies in blocks_on for n, t in copies.items()]:
        assert torch.equal(t, cast[name]), f"{name}: cast again to the forward's values"
    assert float(on._one_rank.last_norm) == float(off._one_rank.last_norm)
    for (name, p), q in zip(on.named_parameters(), off.parameters()):
        assert p.grad is not None and torch.equal(p.grad.to_local(), q.grad.to_local()), name
    fp32 = build(reshard, "fp32")  # the fp32 "copies" are the masters' own tensors: never freed
    fp32(*batch(1))
    blocks, rest = copies_by_block(fp32)
    assert not fp32._one_rank.resharded and not any(freed(c) for c in [*blocks, rest])


def test_training_with_freed_copies_equals_keeping_them(pg):
    on = train(build("auto"), between=check_freed(True))
    off = train(build("never"), between=check_freed(False))
    assert_same_training(on, off)


def test_forwards_without_their_backward_leave_the_next_steps_correct(pg):
    def steps(reshard: str) -> tuple:
        model = build(reshard)
        first = model(*batch(1))
        with torch.no_grad():  # an evaluation forward between a forward and its backward
            model(*batch(2))
        assert len(model._one_rank.pending) == 1
        check_freed(reshard != "never")(model, 1)  # the first forward's copies: still freed, untouched
        first.backward()
        clip_grad_norm_(model, CLIP)
        model.zero_grad(set_to_none=True)
        model(*batch(3))  # a forward whose backward never runs
        check_freed(reshard != "never")(model, 3)

        def boom(module, args):
            raise RuntimeError("boom")

        hook = model.layers[-1].register_forward_pre_hook(boom)  # after the other blocks freed their copies
        with pytest.raises(RuntimeError, match="boom"):
            model(*batch(4))
        hook.remove()
        return train(model)  # the abandoned forward's copies are still pending: the first step clips afterwards

    assert_same_training(steps("auto"), steps("never"))


def test_parameters_shared_with_other_modules_are_kept(pg):
    def tie(model: torch.nn.Module) -> None:
        model.layers[0].attention_norm.weight = model.norm.weight  # shared with a module outside the blocks
        model.layers[1].feed_forward.w1.weight = model.layers[0].feed_forward.w1.weight  # by two blocks

    shared = {"layers.0.attention_norm.weight", "layers.0.feed_forward.w1.weight"}

    def between(model: torch.nn.Module, step: int) -> None:
        blocks, _ = copies_by_block(model)
        for copies in blocks[:2]:
            assert freed(copies) == set(copies) - shared - {"layers.1.feed_forward.w1.weight"}
            assert freed(copies)

    model = build("auto", tie=tie)
    assert model.layers[0].attention_norm.weight is model.norm.weight
    assert_same_training(train(model, between=between), train(build("never", tie=tie)))


@pytest.mark.slow
def test_compiled_blocks_free_and_refill_their_copies(pg):
    """``torch.compile`` per block: the hooks sit on the compiled wrapper ``model.layers`` holds; the compiled
    backward reads the copies it saved, refilled."""
    torch._dynamo.reset()
    model = build("auto", compile=True)
    assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in model.layers)
    on = train(model, steps=2, between=check_freed(True))
    off = train(build("never", compile=True), steps=2, between=check_freed(False))
    assert_same_training(on, off)
    eager = train(build("never"), steps=2)
    assert on[0] != eager[0], "compiled code ran"
