"""Where a new GPU worker's first model build, restore warm-up and steps go, each variant in a fresh interpreter.

``python bench/cold_phases.py [--config 1b] [--variants cold,prewarm,reserved]`` prints one JSON line per variant
(``figure: cold_phases``), each phase synchronised and timed in seconds:

- ``context``: the CUDA context and a first kernel;
- ``prewarm`` (variant ``prewarm`` only): ``trainer.startup.warmup.for_standby``, what a warm standby runs before
  it is needed (the warm-up's load stage at small shapes);
- ``reserve`` (variant ``reserved`` only): one allocation of ``--reserve-gib`` freed into the allocator's cache,
  to show what the build and the first step pay for ``cudaMalloc``;
- ``model``, ``optimizer``: ``build_model`` and ``build_optimizer`` of the configured model (``trainer.startup.phases``'
  ``model`` phase);
- ``warm_up``: ``warm_up_step`` (the restore's warm-up forward and backward);
- ``step_1``, ``step_2``: a forward, backward and optimizer step each.

Compare each variant's ``model`` + ``warm_up`` + ``step_1`` with ``step_2`` (a warm step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys, time
import torch
from trainer.config import load_config
from trainer.parallel import one_rank_group
from trainer.startup.warmup import for_standby
from trainer.train import build_model, build_optimizer, warm_up_step
variant, config, reserve_gib = sys.argv[1], sys.argv[2], float(sys.argv[3])
overrides = sys.argv[4:]
cfg = load_config(config, ["--train.compile=false", "--data.path=unused", *overrides])
cfg.model.vocab_size = cfg.model.vocab_size or 128256
device = torch.device("cuda", 0)
t, mark = {}, time.perf_counter()
def lap(name):
    global mark
    torch.cuda.synchronize(device)
    now = time.perf_counter()
    t[name] = round(now - mark, 3)
    mark = now
torch.cuda.set_device(device)
torch.ones(1, device=device).sum().item()
lap("context")
if variant == "prewarm":
    t["prewarm_line"] = for_standby(cfg, device, 1)
    lap("prewarm")
if variant == "reserved":
    block = torch.empty(int(reserve_gib * 2**30), dtype=torch.uint8, device=device)
    del block
    lap("reserve")
with one_rank_group(device):
    lap("process_group")
    model = build_model(cfg, device)
    lap("model")
    optimizer = build_optimizer(model, cfg.optim)
    lap("optimizer")
    warm_up_step(model, cfg.train.batch_size, cfg.data.seq_len, device)
    lap("warm_up")
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len), device=device)
    for name in ("step_1", "step_2"):
        model(tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lap(name)
    t["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
print(json.dumps(t))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="1b")
    parser.add_argument("--variants", default="cold,prewarm,reserved")
    parser.add_argument("--reserve-gib", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="trainer overrides, e.g. --train.batch_size=2")
    args = parser.parse_args()
    env_path = os.pathsep.join([str(ROOT / "trainer_image"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    for _ in range(args.repeats):
        for variant in args.variants.split(","):
            done = subprocess.run([sys.executable, "-c", PROBE, variant, args.config, str(args.reserve_gib),
                                   *args.overrides], capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": env_path})
            if done.returncode:
                print(json.dumps({"figure": "cold_phases", "variant": variant, "error": done.stderr[-2000:]}))
                continue
            print(json.dumps({"figure": "cold_phases", "variant": variant,
                              **json.loads(done.stdout.strip().splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
