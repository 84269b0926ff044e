"""LocalShardAdamW (trainer/optimizer.py): AdamW stepped on the local shards of DTensor parameters gives exactly
what AdamW gives on the DTensors, with the same state (DTensor moments, a plain step), for each implementation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer import train
from trainer.config import load_config
from trainer.optimizer import LocalShardAdamW


@pytest.fixture(scope="module")
def one_rank_group():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def _train(optimizer_cls, implementation: str, monkeypatch) -> tuple[list[torch.Tensor], dict, dict]:
    monkeypatch.setattr(train, "LocalShardAdamW", optimizer_cls)
    cfg = load_config("tiny", ["--data.path=d", f"--optim.implementation={implementation}", "--model.vocab_size=256",
                               "--data.seq_len=32", "--train.batch_size=2", "--optim.weight_decay=0.1"])
    model = train.build_model(cfg, torch.device("cpu"))
    optimizer = train.build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for step in range(1, 5):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * step  # changes every step, as the trainer's schedule does
        model(tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = [p.detach().to_local().clone() for p in model.parameters()]
    first = optimizer.state[next(model.parameters())]
    return params, {k: type(v) for k, v in first.items()}, optimizer.state_dict()


@pytest.mark.parametrize("implementation", ["for_loop", "foreach", "fused"])
def test_local_shard_step_is_adamw_bit_for_bit(one_rank_group, monkeypatch, implementation):
    expected, expected_types, expected_sd = _train(torch.optim.AdamW, implementation, monkeypatch)
    got, got_types, got_sd = _train(LocalShardAdamW, implementation, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert got_types == expected_types and got_types["exp_avg"] is DTensor
    assert got_sd["param_groups"] == expected_sd["param_groups"]
    assert list(got_sd["state"]) == list(expected_sd["state"])
    for index, state in expected_sd["state"].items():
        for key, value in state.items():
            other = got_sd["state"][index][key]
            if isinstance(value, DTensor):
                assert isinstance(other, DTensor) and other.placements == value.placements
                value, other = value.to_local(), other.to_local()
            assert torch.equal(value, other), (index, key)


def _fresh(implementation: str):
    cfg = load_config("tiny", ["--data.path=d", f"--optim.implementation={implementation}", "--model.vocab_size=256",
                               "--data.seq_len=32", "--train.batch_size=2"])
    model = train.build_model(cfg, torch.device("cpu"))
    return model, train.build_optimizer(model, cfg.optim)


def _layout(optimizer) -> list[tuple]:
    """Each state entry's name, type, dtype, device, local shape and placements, in the optimizer's order."""
    out = []
    for param, state in optimizer.state.items():
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            out.append((tuple(param.shape), key, type(value).__name__, local.dtype, local.device.type,
                        tuple(local.shape), getattr(value, "placements", None)))
    return out


@pytest.mark.parametrize("implementation", ["for_loop", "foreach", "fused"])
def test_init_state_makes_what_the_state_dict_apis_zero_step_makes_without_a_step(one_rank_group, implementation):
    """``LocalShardAdamW.init_state``: the restore's state-dict walk finds every state tensor there, laid out as the
    state-dict API's zero step would have made them (the snapshot layouts compare equal), with no step taken: the
    parameters untouched and no gradient allocated. A second call, or one on an optimizer with state, does nothing."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, stepped = _fresh(implementation)
    get_state_dict(model, stepped)  # the API's own initialisation: a step of zero gradients at lr 0
    expected = _layout(stepped)
    model, optimizer = _fresh(implementation)
    before = [p.detach().to_local().clone() for p in model.parameters()]

    def no_step(*args, **kwargs):
        raise AssertionError("init_state took a step")

    optimizer.step = no_step
    assert optimizer.init_state() and not optimizer.init_state()
    assert _layout(optimizer) == expected
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))
    for state in optimizer.state.values():
        assert float(state["step"]) == 0 and not state["exp_avg"].to_local().any()
    _, sd = get_state_dict(model, optimizer)  # the API finds state and takes no step of its own
    assert len(sd["state"]) == len(expected) // 3
