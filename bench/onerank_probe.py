"""Two measurements behind ``OneRank``'s choices on one GPU, each a same-call comparison (JSON lines on stdout).

    python bench/onerank_probe.py cast  [--config 1b] [--reps 20]
    python bench/onerank_probe.py abort [--reps 5]

``cast``: the end of a one-rank backward turns each bf16 gradient into its fp32 gradient times clipping's
coefficient. For the config's real parameter shapes (random bf16 gradients), each way of doing it: its time on
the GPU (CUDA events, median over ``--reps`` passes over every gradient) and whether its result is bit-identical
to the reference ``torch.mul(g, coef, out=fp32)``; the memory-traffic floor beside them (read 2 bytes, write 4
per element, at the bandwidth a plain fp32 copy of the same bytes reaches here). On one H200 (1b, 147 gradients)
the mixed-dtype ``mul`` beats a cast then ``_foreach_mul_`` and a compiled kernel per gradient (its per-call
overhead), close to the cast alone: ``OneRank`` keeps the ``mul``.

``abort``: what NVRx's ``AbortTorchDistributed`` (the in-process restart's abort) costs on a one-rank NCCL group,
with the communicator created at ``init_process_group`` (``device_id`` given: eager) and without (lazy: no
collective at one rank, so no communicator), each in a fresh process, ``--reps`` init/abort cycles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))


def _shapes(config: str) -> list[tuple[int, ...]]:
    from trainer.config import parse_args
    from trainer.model import Transformer

    _, cfg = parse_args(["--config", config, "--data.path=unused"])
    with torch.device("meta"):
        return [tuple(p.shape) for p in Transformer(cfg.model, cfg.data.seq_len).parameters()]


def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` on the GPU's timeline."""
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def cast(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) * 1e-3 for s in _shapes(args.config)]
    coef = torch.tensor([0.731], device=device)
    numel = sum(g.numel() for g in grads)
    reference = [torch.mul(g, coef, out=torch.empty_like(g, dtype=torch.float32)) for g in grads]

    compiled = torch.compile(lambda flat, c: flat.float() * c, dynamic=True, fullgraph=True)  # one kernel, any length

    def two_pass() -> list[torch.Tensor]:
        out = [g.to(torch.float32) for g in grads]
        torch._foreach_mul_(out, coef.reshape(()))
        return out

    variants = {
        "mul_out_mixed (before)": lambda: [torch.mul(g, coef, out=torch.empty_like(g, dtype=torch.float32))
                                           for g in grads],
        "cast_then_foreach_mul": two_pass,
        "compiled per tensor": lambda: [compiled(g.reshape(-1).detach(), coef.reshape(())).view(g.shape)
                                        for g in grads],
        "cast only, no clipping (to fp32)": lambda: [g.to(torch.float32) for g in grads],
    }
    src, dst = ([torch.empty_like(g, dtype=torch.float32) for g in grads] for _ in range(2))
    copy_ms = _time(lambda: [d.copy_(s) for d, s in zip(dst, src)], args.reps)  # read 4 + write 4 bytes per element
    del src, dst
    floor_ms = copy_ms * 6 / 8
    for name, fn in variants.items():
        out = fn()
        same = all(torch.equal(a, b) for a, b in zip(out, reference))  # the cast only: False when coef < 1
        del out
        ms = _time(fn, args.reps)
        print(json.dumps({"figure": "grad_cast", "variant": name, "ms": round(ms, 3), "bit_identical": same,
                          "floor_ms": round(floor_ms, 3), "params": numel, "tensors": len(grads),
                          "config": args.config}), flush=True)


def abort(args: argparse.Namespace) -> None:
    if args.mode:  # a child: one mode, fresh process
        import datetime

        import torch.distributed as dist
        from nvidia_resiliency_ext.inprocess.abort import AbortTorchDistributed

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        x = torch.randn(4096, 4096, device=device)
        times = []
        for _ in range(args.reps):
            kwargs = {"device_id": device} if args.mode == "eager" else {}
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60), **kwargs)
            for _ in range(20):
                x = (x @ x).clamp_(-1, 1)  # the GPU busy when the fault comes, as in training
            started = time.perf_counter()
            AbortTorchDistributed()(None)
            times.append(time.perf_counter() - started)
            torch.cuda.synchronize()
        print(json.dumps({"figure": "nccl_abort", "mode": args.mode, "world_size": 1,
                          "abort_s": [round(t, 4) for t in times],
                          "median_s": round(statistics.median(times), 4)}), flush=True)
        return
    for mode in ("eager", "lazy", "eager", "lazy"):
        subprocess.run([sys.executable, __file__, "abort", "--mode", mode, "--reps", str(args.reps)],
                       check=True, env=os.environ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["cast", "abort"])
    parser.add_argument("--config", default="1b")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--mode", choices=["eager", "lazy"])
    args = parser.parse_args()
    {"cast": cast, "abort": abort}[args.what](args)


if __name__ == "__main__":
    main()
