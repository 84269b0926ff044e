"""Live Python objects added per optimizer step with DTensor parameters, per AdamW implementation, on one GPU.

``python bench/dtensor_leak.py`` builds a 4-block ``1b``-shaped model with the trainer's code (``OneRank``: one-rank
DTensor parameters, as FSDP2's) and prints one JSON line per (optimizer, implementation): live ``DTensorSpec``
objects and all gc-tracked objects added over 30 steps. On torch 2.10/2.11 ``torch.optim.AdamW`` over DTensors
leaks about one spec per parameter per step (pytorch/pytorch#181761); ``LocalShardAdamW`` (trainer/optimizer.py)
steps on the local shards.
"""

from __future__ import annotations

import gc
import json

import torch

from trainer import train
from trainer.config import load_config
from trainer.optimizer import LocalShardAdamW
from trainer.parallel import one_rank_group


def count() -> tuple[int, int]:
    gc.collect()
    objects = gc.get_objects()
    return sum(1 for o in objects if type(o).__name__ == "DTensorSpec"), len(objects)


def main() -> None:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with one_rank_group(device):
        measure(device)


def measure(device: torch.device) -> None:
    for cls in (torch.optim.AdamW, LocalShardAdamW):
        for implementation in ("fused", "foreach"):
            train.LocalShardAdamW = cls
            cfg = load_config("1b", ["--data.path=unused", f"--optim.implementation={implementation}",
                                     "--model.vocab_size=4096", "--data.seq_len=256", "--train.batch_size=1",
                                     "--model.n_layers=4", "--train.compile=false"])
            model = train.build_model(cfg, device)
            optimizer = train.build_optimizer(model, cfg.optim)
            tokens = torch.zeros((1, 256), dtype=torch.long, device=device)
            marks = []
            for step in range(1, 41):
                for group in optimizer.param_groups:
                    group["lr"] = 1e-4 * step / 40
                model(tokens, tokens).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step in (10, 40):
                    marks.append(count())
            print(json.dumps({"figure": "dtensor_leak", "torch": torch.__version__, "optimizer": cls.__name__,
                              "implementation": implementation, "params": len(list(model.parameters())),
                              "specs_per_step": round((marks[1][0] - marks[0][0]) / 30, 1),
                              "objects_per_step": round((marks[1][1] - marks[0][1]) / 30, 1)}), flush=True)
            del model, optimizer
    train.LocalShardAdamW = LocalShardAdamW


if __name__ == "__main__":
    main()
