"""A shrink and a grow on this machine's CPUs (``tests/nodeharness.py``: two ``entrypoint.sh`` nodes of ``--nproc``
workers under ``PET_NNODES=1:2``, the tiny model on gloo, the node range's global batch), one JSON line per change of
size.

    PYTHONPATH=.:trainer_image:tests:tests/resiliency .venv/bin/python bench/elastic_cpu.py --data DIR [--runs 3]

Each run waits for the full size, loses node 1 (every process SIGKILLed, its node memory gone) a number of steps later
drawn anew, lets node 0 train alone for 8 steps, then starts node 1 again. Per change of size, from the ledger: the
sizes, the layer, the seconds from the fault (the shrink: the loss; the grow: the restart the join caused) to the
first productive step, and the steps redone. ``TRAINER_NODE_WAIT_S`` (default here 5) is part of a shrink's seconds:
the others wait that long for the lost node.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from nodeharness import Cluster
from test_elastic import full_size_from
from test_recovery import BASE, FT_ENV, GRACE, HANGS
from trainer.ledger import read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--node-wait", default="5")
    parser.add_argument("--nproc", type=int, default=1, help="workers per node")
    args = parser.parse_args()
    trainer = [*(a for a in BASE if not a.startswith(("--train.steps", "--train.batch_size"))),
               f"--train.steps={args.steps}", "--train.cpu_threads=1", "--train.batch_size=2", *GRACE, *HANGS]
    env = {**FT_ENV, "FT_RDZV_KEEP_ALIVE_S": "1", "FT_MAX_RESTARTS": "6", "TRAINER_NODE_WAIT_S": args.node_wait}
    root = Path(tempfile.mkdtemp(prefix="elastic-bench."))
    seed = int.from_bytes(os.urandom(4), "little")
    draw = random.Random(seed)
    print(json.dumps({"figure": "elastic_bench", "seed": seed, "steps": args.steps, "node_wait_s": args.node_wait,
                      "nproc": args.nproc, "root": str(root)}), flush=True)
    for i in range(args.runs):
        lose_at = draw.randint(6, 12)
        began = time.time()
        with Cluster(root / f"run{i}", args.data, "1:2", args.nproc, trainer, env=env) as cluster:
            cluster.start_all()
            lose_at += full_size_from(cluster, 2 * args.nproc)
            cluster.wait_for_step(lose_at, timeout=240)
            cluster.lose(next(n for n in cluster.nodes if n.rank == 1))
            cluster.wait_for_step(lose_at + 8, timeout=240)
            cluster.start(1)
            codes = cluster.run_to_end(timeout=300)
            ledger = read(cluster.run_dir / "recovery.jsonl")
        changes = [r for r in ledger if r["event"] == "elastic"]
        recovered = [r for r in ledger if r["event"] == "recovered"]
        for change in changes:  # the first productive step after the restart that changed the size
            after = next((r for r in recovered if r["time"] >= change["time"]), {})
            print(json.dumps({"figure": "elastic", "run": i, "lost_at": lose_at, "before": change["before"],
                              "after": change["after"], "layer": change["layer"], "cause": change["cause"],
                              "resumed_step": change["step"], "recovery_s": after.get("recovery_s"),
                              "steps_redone": after.get("steps_redone"), "tiers": after.get("tiers")}), flush=True)
        print(json.dumps({"figure": "elastic_run", "run": i, "codes": codes, "wall_s": round(time.time() - began, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
