"""Where a new worker's cold start goes, each variant in a fresh interpreter (one JSON line each).

``python bench/startup_probe.py [--device cuda]`` times, from the interpreter's creation (``trainer.startup.phases``):

- ``serial``: import torch, make the CUDA context, then import the trainer's modules (the order before this work);
- ``overlapped``: import torch, make the context in a background thread (``phases.warm_cuda``, as ``trainer.cli``
  now does) while the trainer's modules are imported, then wait for it (``torch.cuda.set_device``).

Each line: ``import_torch_s``, ``context_s`` (``serial`` only), ``trainer_imports_s`` and ``total_s``. The difference
of the totals is what the overlap saves (nothing when the driver holds the GIL throughout).
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
from trainer.startup import phases
origin = phases.process_start_time()
mode, device = sys.argv[1], sys.argv[2]
t = {}
import torch
t["import_torch_s"] = time.time() - origin
mark = time.time()
if mode == "serial":
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")
    t["context_s"] = time.time() - mark
    mark = time.time()
else:
    phases.warm_cuda(device, 0)
import trainer.train, trainer.resiliency, trainer.health, trainer.checkpoint.writer  # noqa: E401,F401
from nvidia_resiliency_ext import inprocess  # noqa: F401
from nvidia_resiliency_ext.inprocess import nested_restarter  # noqa: F401
t["trainer_imports_s"] = time.time() - mark
if device == "cuda":
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
t["total_s"] = time.time() - origin
print(json.dumps({k: round(v, 3) for k, v in t.items()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    env_path = os.pathsep.join([str(ROOT / "trainer_image"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    for _ in range(args.repeats):
        for mode in ("serial", "overlapped"):
            out = subprocess.run([sys.executable, "-c", PROBE, mode, args.device], capture_output=True, text=True,
                                 check=True, env={**os.environ, "PYTHONPATH": env_path}).stdout
            print(json.dumps({"figure": "cold_start", "mode": mode, "device": args.device,
                              **json.loads(out.strip().splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
