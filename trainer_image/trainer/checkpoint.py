"""Checkpoint manager (interim synchronous DCP implementation; the async NVRx one replaces it).

Interface used by the training loop: ``load_latest(state)``, ``save(step, state, last_step=...)``,
``wait_for_staging()`` and ``close()``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.config import CheckpointConfig
from trainer.parallel import DistEnv

log = logging.getLogger(__name__)


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, directory: Path, env: DistEnv, config_json: str) -> None:
        self.cfg, self.dir, self.env, self.config_json = cfg, Path(directory), env, config_json

    def _flat(self, state: dict[str, Any]) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(state["model"], state["optimizer"])
        return {"model": model_sd, "optimizer": optim_sd, "progress": state["progress"].state_dict(),
                "dataloader": state["dataloader"].state_dict()}

    def load_latest(self, state: dict[str, Any]) -> int | None:
        steps = sorted(int(p.name.split("-")[1]) for p in self.dir.glob("step-*") if (p / ".metadata").exists())
        if not self.cfg.resume or not steps:
            return None
        flat = self._flat(state)
        dcp.load(flat, checkpoint_id=str(self.dir / f"step-{steps[-1]:08d}"))
        set_state_dict(state["model"], state["optimizer"], model_state_dict=flat["model"],
                       optim_state_dict=flat["optimizer"])
        state["progress"].load_state_dict(flat["progress"])
        state["dataloader"].load_state_dict(flat["dataloader"])
        return steps[-1]

    def save(self, step: int, state: dict[str, Any], last_step: bool = False) -> bool:
        if not (last_step or (self.cfg.interval and step % self.cfg.interval == 0)):
            return False
        dcp.save(self._flat(state), checkpoint_id=str(self.dir / f"step-{step:08d}"))
        dist.barrier()
        return True

    def wait_for_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def load_model_weights(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """The full (unsharded) model weights of a checkpoint, in one process without a process group."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    directory = Path(directory)
    if step is None:
        step = max(int(p.name.split("-")[1]) for p in directory.glob("step-*") if (p / ".metadata").exists())
    flat = _load_state_dict_from_keys(checkpoint_id=str(directory / f"step-{step:08d}"))
    return flat["model"]
