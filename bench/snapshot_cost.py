"""What a device-staged memory snapshot costs the next training step, part by part, on one GPU.

``python bench/snapshot_cost.py [--config 1b] [--steps 16]`` builds the configured model with the trainer's own
code (eager) and trains it on random tokens. Each variant takes a snapshot-like copy of the model's and the
optimizer's tensors after every other optimizer step, on a side stream as ``trainer/checkpoint/staging.py`` does
(the training stream waits on the device for the sources to be read before the next ``optimizer.step()``), and
prints one JSON line (``figure: snapshot_cost``): the median step after a snapshot, the median step after none,
and the difference in milliseconds. Variants (cumulative, as the product runs them):

- ``foreach``: ``torch._foreach_copy_`` into a device staging buffer (the product's device-to-device copy);
- ``memcpy``: one ``copy_`` per tensor instead (a ``cudaMemcpyAsync`` each);
- ``+checksum``: then one int64 sum over the staging buffer (the node-local checksum);
- ``+drain``: then the device-to-host copy of the buffer into page-locked host memory, in 1 GiB pieces;
- ``direct``: device-to-host copies straight from the tensors, no staging (``checkpoint.device_staging=off``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from trainer.config import load_config
from trainer.parallel import one_rank_group
from trainer.train import build_model, build_optimizer

PIECE = 1 << 30


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.to_local() if hasattr(p, "to_local") else p)
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.is_cuda:
                out.append(value.to_local() if hasattr(value, "to_local") else value)
    return [t.detach() for t in out]


class Snapshot:
    def __init__(self, tensors: list[torch.Tensor], variant: str, host: torch.Tensor, device: torch.device) -> None:
        self.tensors, self.variant, self.host = tensors, variant, host
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.stream = torch.cuda.Stream(device)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device) if variant != "direct" else None
        self.views, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if self.buffer is not None:
                self.views.append(self.buffer[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
        self.sum = torch.zeros((), dtype=torch.int64, pin_memory=True)
        self.read: torch.cuda.Event | None = None

    def take(self) -> None:
        v = self.variant
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if v == "direct":
                offset = 0
                for t in self.tensors:
                    n = t.numel() * t.element_size()
                    self.host[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
                    offset += n
            else:
                if v.startswith("foreach"):
                    torch._foreach_copy_(self.views, self.tensors)
                else:
                    for d, s in zip(self.views, self.tensors):
                        d.copy_(s)
            self.read = torch.cuda.Event()
            self.read.record(self.stream)
            if "+checksum" in v:
                self.sum.copy_(self.buffer[: self.nbytes // 8 * 8].view(torch.int64).sum(), non_blocking=True)
            if "+drain" in v:
                for a in range(0, self.nbytes, PIECE):
                    b = min(self.nbytes, a + PIECE)
                    self.host[a:b].copy_(self.buffer[a:b], non_blocking=True)

    def before_optimizer_step(self) -> None:
        if self.read is not None:
            torch.cuda.current_stream().wait_event(self.read)
            self.read = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="1b")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--variants", default="foreach,memcpy,foreach+checksum,foreach+checksum+drain,"
                                              "memcpy+checksum+drain,direct")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, ["--train.compile=false", "--data.path=unused", *args.overrides])
    cfg.model.vocab_size = cfg.model.vocab_size or 128256
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with one_rank_group(device):
        run(args, cfg, device)


def run(args: argparse.Namespace, cfg: Any, device: torch.device) -> None:
    model = build_model(cfg, device)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len), device=device)

    def step(snapshot: Snapshot | None) -> None:
        model(tokens, tokens).backward()
        if snapshot is not None:
            snapshot.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step(None)
    tensors = state_tensors(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    print(json.dumps({"figure": "snapshot_cost_setup", "state_gib": round(nbytes / 2**30, 2),
                      "tensors": len(tensors)}), flush=True)
    for variant in args.variants.split(","):
        snapshot = Snapshot(tensors, variant, host, device)
        after, plain = [], []
        main_stream = torch.cuda.current_stream(device)
        for i in range(args.steps):
            if i % 2 == 0:
                torch.cuda.synchronize(device)  # the last snapshot's work is over: a step with nothing beside it
            began = time.perf_counter()
            step(snapshot)
            main_stream.synchronize()  # the training stream only: the drain may go on, as in the trainer
            (after if i % 2 else plain).append(time.perf_counter() - began)
            if i % 2 == 0:  # a snapshot after this step: the next one is timed as "after"
                snapshot.take()
        a, p = statistics.median(after[1:]), statistics.median(plain[1:])
        print(json.dumps({"figure": "snapshot_cost", "variant": variant, "step_after_ms": round(a * 1e3, 1),
                          "step_plain_ms": round(p * 1e3, 1), "cost_ms": round((a - p) * 1e3, 1)}), flush=True)
        del snapshot
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
