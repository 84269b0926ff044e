"""Two nodes on this machine's CPUs (``tests/nodeharness.py``: one ``entrypoint.sh`` per node, one worker each, the
tiny model on gloo): every recovery layer's cost across nodes, one JSON line per recovery.

    PYTHONPATH=.:trainer_image:tests .venv/bin/python bench/nodes_cpu.py --runs 3 [--steps 60] [--out DIR]

Each run injects, at steps drawn anew (the seed is printed): an exception (in-process), a SIGKILL of a worker
(in-job), a SIGSTOP of a worker (a hung node: in-job, once its monitors end it), the ``node_lost`` fault (a node
and its memory gone; the replacement pod started at once) and the loss of the node hosting the rendezvous's store
(from outside; replacement at once). Per recovery: the layer, the fault, the seconds from the fault to the first
productive step and the steps redone, from the ledger (``recovered`` records) where the trainer injected the
fault, from outside where the bench did (the fault's wall time to the next step record's end in ``metrics.jsonl``,
and the step reached against the step resumed from). Then the run's wall time and the same steps without faults.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from nodeharness import Cluster
from testlib import read_jsonl
from trainer.ledger import read

SMALL = ["--config", "tiny", "--train.batch_size=2", "--data.seq_len=64", "--checkpoint.interval=4",
         "--checkpoint.keep=3", "--train.cpu_threads=1", "--resiliency.preemption_grace_s=10",
         "--resiliency.inprocess=true", "--resiliency.collective_timeout_s=2", "--resiliency.soft_timeout_s=4",
         "--resiliency.hard_timeout_s=8", "--resiliency.heartbeat_timeout_s=10", "--resiliency.termination_grace_s=1"]
ENV = {"FT_RANK_HEARTBEAT_TIMEOUT": "30", "FT_INITIAL_RANK_HEARTBEAT_TIMEOUT": "60", "FT_WORKLOAD_CHECK_INTERVAL": "1",
       "FT_WORKERS_STOP_TIMEOUT": "5", "FT_TERM_TIMEOUT": "20", "FT_MAX_RESTARTS": "6", "FT_RDZV_KEEP_ALIVE_S": "1"}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _step_after(cluster: Cluster, moment: float) -> dict | None:
    """The first step record that ended after ``moment`` (the first productive step after a fault at ``moment``)."""
    later = [r for r in read_jsonl(cluster.run_dir / "metrics.jsonl") if r.get("event") == "step" and r["time"] > moment]
    return later[0] if later else None


def one_run(dataset: Path, base: Path, steps: int, seed: int) -> None:
    draw = random.Random(seed)
    cut = steps // 5
    exception, sigkill, stop, lost, host = (draw.randint(i * cut + 2, (i + 1) * cut - 1) for i in range(5))
    faults = f"1:{exception}:exception,0:{sigkill}:sigkill,0:{lost}:node_lost"
    emit({"figure": "nodes_run", "seed": seed, "steps": steps, "exception": exception, "sigkill": sigkill,
          "sigstop": stop, "node_lost": lost, "store_host_lost": host})
    args = [*SMALL, f"--train.steps={steps}", f"--resiliency.faults={faults}"]
    outside = []
    began = time.time()
    with Cluster(base, dataset, 2, 1, args, env=ENV) as cluster:
        cluster.start_all()
        cluster.wait_for_step(stop, timeout=300)
        os.kill(next(n for n in reversed(cluster.nodes) if not n.lost and n.rank == 1).workers()[0], signal.SIGSTOP)
        outside.append(("sigstop", time.time(), cluster.steps()[-1]))
        cluster.wait_for_step(host, timeout=300)
        victim = next(n for n in reversed(cluster.nodes) if not n.lost and "hosts the TCP store" in n.output())
        outside.append(("store_host_lost", time.time(), cluster.steps()[-1]))
        cluster.lose(victim)
        cluster.start(victim.rank)
        codes = cluster.run_to_end(timeout=300)
        wall = time.time() - began
        ledger = read(cluster.run_dir / "recovery.jsonl")
        for r in ledger:
            if r["event"] == "recovered" and r.get("fault_kind") in ("exception", "sigkill", "node_lost"):
                emit({"figure": "recovery", "seed": seed, "layer": r["layer"], "fault": r["fault_kind"],
                      "fault_step": r["fault_step"], "recovery_s": r["recovery_s"], "steps_redone": r["steps_redone"],
                      "tiers": r.get("tiers"), "source": "ledger"})
        for kind, moment, last_step in outside:
            after = _step_after(cluster, moment + 0.5)  # past the step that was running then
            restart = next((r for r in ledger if r["event"] == "recovered" and r["time"] > moment), None)
            if after is None or restart is None:
                emit({"figure": "recovery", "seed": seed, "fault": kind, "error": "no step after it"})
                continue
            emit({"figure": "recovery", "seed": seed, "layer": restart["layer"], "fault": kind,
                  "fault_step": last_step + 1, "recovery_s": round(restart["time"] - moment, 3),
                  "steps_redone": last_step - (restart["step"] - 1), "tiers": restart.get("tiers"),
                  "source": "outside"})
        summary = next((r for r in reversed(ledger) if r["event"] == "summary"), {})
        emit({"figure": "nodes_run_end", "seed": seed, "codes": codes, "wall_s": round(wall, 1),
              "goodput": summary.get("goodput"), "by_layer": summary.get("by_layer")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--data", type=Path, help="a token-shard dataset (default: built from the stdlib, 2 MB)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="nodes-bench."))
    dataset = args.data
    if dataset is None:
        from components.lib.tokendata import build_dataset, default_corpus

        dataset = root / "data"
        if not (dataset / "manifest.json").exists():
            build_dataset(default_corpus(), dataset, vocab_size=2048, max_bytes=2_000_000, seed=0)
    for i in range(args.runs):
        seed = int.from_bytes(os.urandom(4), "little")
        one_run(dataset, root / f"run{i}", args.steps, seed)
    print(f"# runs under {root}", file=sys.stderr)


if __name__ == "__main__":
    main()
