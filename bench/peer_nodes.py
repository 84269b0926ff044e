"""The peer tier across two nodes on one host (``tests/nodeharness.py``: one ``entrypoint.sh`` per node, one worker
each; on a GPU host one GPU a node and NCCL between them, else the CPU and gloo), one JSON line per figure.

    # two GPUs (bench/gpu_suite.sh peer): 1b eager, a snapshot every 10 steps, every 2nd persisted
    source bench/gpu_env.sh; PYTHONPATH=$PYTHONPATH:tests python3 bench/peer_nodes.py --data DIR [--steps 80]
    # this machine's CPUs: the tiny model, trainer flags after the bench's own
    PYTHONPATH=.:trainer_image:tests .venv/bin/python bench/peer_nodes.py --data DIR --config tiny --steps 40 \
        --interval 4 --out /dev/shm/peer --train.batch_size=2 --data.seq_len=64 --train.cpu_threads=1

``--plan`` (default ``clean:0,clean:auto,lost:auto,lost:0``) lists the runs, each ``kind:checkpoint.replicas``:
``clean`` runs without faults (the step time, and the steps just after each snapshot, where the replica is pushed);
``lost`` loses node 1 from outside at a step drawn anew (every process SIGKILLed, its node-local directory removed)
and starts it again at once as the replacement pod: the ledger's ``recovered`` records (seconds from the fault to
the first productive step, steps redone, the tier of each rank, bytes read per tier).
What one host cannot show: the replica crosses loopback (``sendfile`` between two processes), not a NIC.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from nodeharness import Cluster
from testlib import read_jsonl
from trainer.ledger import read

ENV = {"FT_RANK_HEARTBEAT_TIMEOUT": "120", "FT_INITIAL_RANK_HEARTBEAT_TIMEOUT": "300", "FT_WORKLOAD_CHECK_INTERVAL": "1",
       "FT_WORKERS_STOP_TIMEOUT": "10", "FT_TERM_TIMEOUT": "30", "FT_MAX_RESTARTS": "3", "FT_RDZV_KEEP_ALIVE_S": "1",
       "OMP_NUM_THREADS": "4"}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _start(cluster: Cluster, rank: int) -> None:
    cluster.start(rank, extra_env={"CUDA_VISIBLE_DEVICES": str(rank)})


def _step_figures(run_dir: Path, interval: int, skip: int) -> dict:
    """Median step time after ``skip`` steps, the mean of the 3 steps after each snapshot and of the others."""
    steps = {r["step"]: r["step_time_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "step"}
    kept = {s: t for s, t in steps.items() if s > skip}
    after = [t for s, t in kept.items() if 0 < s % interval <= 3]
    rest = [t for s, t in kept.items() if not 0 < s % interval <= 3]
    return {"steps": len(kept), "median_s": round(statistics.median(kept.values()), 4),
            "mean_s": round(statistics.fmean(kept.values()), 4),
            "after_snapshot_mean_s": round(statistics.fmean(after), 4) if after else None,
            "other_mean_s": round(statistics.fmean(rest), 4) if rest else None}


def one(base: Path, dataset: Path, args: argparse.Namespace, replicas: str, lose_at: int | None) -> None:
    flags = ["--config", args.config, f"--train.steps={args.steps}", "--train.compile=false", "--train.log_every=1",
             f"--checkpoint.interval={args.interval}", f"--checkpoint.persist_every={args.persist_every}",
             f"--checkpoint.replicas={replicas}", f"--checkpoint.dir={args.ckpt / base.name}", "--resiliency.inprocess=true", *args.extra]
    began = time.time()
    with Cluster(base, dataset, 2, 1, flags, env=ENV) as cluster:
        for rank in (0, 1):
            _start(cluster, rank)
        if lose_at is not None:
            cluster.wait_for_step(lose_at, timeout=400)
            victim = next(n for n in cluster.nodes if n.rank == 1 and not n.lost)
            cluster.lose(victim)
            _start(cluster, 1)
        codes = cluster.run_to_end(timeout=500)
        record = {"figure": "peer_run", "replicas": replicas, "lost_at": lose_at, "codes": codes,
                  "wall_s": round(time.time() - began, 1), **_step_figures(cluster.run_dir, args.interval, 10)}
        if lose_at is not None:
            ledger = [r for r in read(cluster.run_dir / "recovery.jsonl") if r["event"] == "recovered"]
            record["recovered"] = [{k: r.get(k) for k in ("layer", "step", "recovery_s", "steps_redone", "tiers",
                                                          "bytes_read", "phases")} for r in ledger]
        emit(record)
    shutil.rmtree(args.ckpt / base.name, ignore_errors=True)  # the next run's disk room (17 GB a checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--persist-every", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/dev/shm"),
                        help="where a new directory holds the run directories and each node's node-local directory: "
                             "memory-backed (default: /dev/shm)")
    parser.add_argument("--ckpt", type=Path, default=Path(".bench-ckpt/peer"), help="checkpoint.dir's parent (disk)")
    parser.add_argument("--plan", default="clean:0,clean:auto,lost:auto,lost:0")
    parser.add_argument("--config", default="1b")
    args, args.extra = parser.parse_known_args()  # the rest: trainer flags for every run
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="peer-nodes.", dir=args.out))  # never an earlier bench's ledger or metrics
    seed = int.from_bytes(os.urandom(4), "little")
    draw = random.Random(seed)
    emit({"figure": "peer_bench", "seed": seed, "steps": args.steps, "interval": args.interval,
          "persist_every": args.persist_every})
    for i, item in enumerate(args.plan.split(",")):
        kind, replicas = item.split(":")
        lose_at = None if kind == "clean" else draw.randint(args.steps // 2, args.steps - 15)
        one(root / f"{i}-{kind}-r{replicas}", args.data, args, replicas, lose_at)


if __name__ == "__main__":
    main()
