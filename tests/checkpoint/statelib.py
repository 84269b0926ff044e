"""A small FSDP2 training state and a single-process CheckpointManager, shared by the checkpoint tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.model import Transformer
from trainer.parallel import DistEnv, apply_fsdp
from trainer.train import TrainProgress, build_optimizer

MODEL = ModelConfig(name="micro", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
SEQ = 8


class FakeLoader:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


@pytest.fixture
def pg():  # noqa: PT004 - imported by the test modules
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_state(seed: int = 0) -> dict:
    model = Transformer(MODEL, max_seq_len=SEQ)
    model.init_weights(seed)
    model = apply_fsdp(model, TrainConfig(device="cpu"), torch.device("cpu"))
    optimizer = build_optimizer(model, OptimConfig())
    return {"model": model, "optimizer": optimizer, "progress": TrainProgress(), "dataloader": FakeLoader()}


def train_step(state: dict, step: int) -> None:
    tokens = torch.randint(0, MODEL.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))
    logits = state["model"](tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["progress"].step = step
    state["dataloader"].position += 2


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors (local), cloned."""
    out = {f"model/{k}": v.to_local().clone() for k, v in state["model"].state_dict().items()}
    for i, (p, st) in enumerate(state["optimizer"].state.items()):
        for name, value in st.items():
            out[f"optim/{i}/{name}"] = (value.to_local() if hasattr(value, "to_local") else value).clone()
    return out


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def disk_only(mgr: CheckpointManager) -> None:
    """As if restarted on a new node: no memory or node-local snapshot, only the persistent tier."""
    for slot in mgr.snapshots.slots:
        mgr.snapshots.drop(slot)


def fail_while_staging(monkeypatch: pytest.MonkeyPatch, mgr: CheckpointManager, state: dict, step: int) -> None:
    """``mgr.save(step)`` fails right after the slot was (re)mapped for the new snapshot, before any tensor was
    copied in: a fault in the middle of staging."""
    from trainer.checkpoint.slots import Slot

    real_ensure = Slot.ensure

    def ensure_then_fail(self, *args, **kwargs):
        real_ensure(self, *args, **kwargs)
        raise RuntimeError("injected fault while staging")

    monkeypatch.setattr(Slot, "ensure", ensure_then_fail)
    with pytest.raises(RuntimeError, match="while staging"):
        mgr.save(step, state)
    monkeypatch.setattr(Slot, "ensure", real_ensure)


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    """Checkpoints in ``tmp_path/ckpt``; the node-local tier in ``tmp_path/node`` (not /dev/shm: nothing leaks)."""
    cfg = CheckpointConfig(**{"interval": 1, "keep": 3, "node_local_dir": str(tmp_path / "node"), **kw})
    mgr = CheckpointManager(cfg, tmp_path / "ckpt", DistEnv(0, 1, 0, 1), config_json=json.dumps({"test": True}))
    mgr.bind()
    return mgr


def save_two_steps(mgr: CheckpointManager, state: dict) -> dict[str, torch.Tensor]:
    """Train and save steps 1 and 2; returns the state at step 1 (what a fallback from a bad step 2 restores)."""
    train_step(state, 1)
    mgr.save(1, state)
    at_step_1 = snapshot(state)
    train_step(state, 2)
    mgr.save(2, state)
    return at_step_1
