"""Drill, run by hand: two ``entrypoint.sh`` nodes (``nodeharness``, test_nodes' arguments: the micro model, 40 steps,
the in-process layer, the peer tier) and one of them lost at a moment drawn in wall-clock time, not at a step: during
the launchers' start, the rendezvous, the workers' imports, a restore, a save, the final save or the end of the run.
Its whole pod is SIGKILLed and its memory removed; the replacement starts at once. Each trial must end with every node
at exit 0 and the weights bit-identical to the fault-free run's.

    .venv/bin/python tests/resiliency/drill_kill_anytime.py --trials 8 [--seed S] [--within 20]

One line per trial (the moment, the node, the step the job had reached, each recovery the ledger recorded, the codes,
whether the weights are the fault-free run's); exit 1 if any trial failed, with its nodes' logs kept under --keep.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

from nodeharness import Cluster  # noqa: E402
from test_nodes import ARGS, ENV, STEPS  # noqa: E402
from test_recovery import BASE, events, torchrun  # noqa: E402
from trainer.checkpoint import load_model_weights  # noqa: E402


NOTABLE = (  # the launchers' lines that say how a loss outside the training steps was met (trainer.resiliency.launch)
    ("a round given up", "did not assign its ranks"),
    ("a node came to the finished run", "the run already finished"),
    ("a node left the rendezvous of the finished run", "finished while this node waited"),
    ("the store's host lost", "joins it again"),
)


def trial(base: Path, dataset: Path, reference: dict, at_s: float, rank: int) -> tuple[bool, str]:
    with Cluster(base, dataset, 2, 1, ARGS, env=ENV) as cluster:
        began = time.monotonic()
        cluster.start_all()
        time.sleep(at_s)
        steps = cluster.steps()
        reached = max(steps) if steps else 0
        node = next(n for n in cluster.nodes if n.rank == rank and not n.lost)
        ended = node.proc.poll() is not None
        cluster.lose(node)
        cluster.start(rank)
        try:
            codes = cluster.run_to_end(timeout=240)
        except AssertionError as e:
            return False, f"lost node{rank} at {at_s:.1f} s (step {reached}): {str(e)[:300]}"
        took = time.monotonic() - began
        recovered = [(r["layer"], r["fault_kind"], r.get("steps_redone"), r.get("tiers"))
                     for r in events(cluster.run_dir, "recovered")]
        same = False
        if set(codes.values()) == {0}:
            weights = load_model_weights(cluster.run_dir / "checkpoints")
            same = weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
        ok = set(codes.values()) == {0} and same
        logs = "".join(n.output() for n in cluster.nodes)
        seen = [what for what, line in NOTABLE if line in logs]
        line = (f"lost node{rank} at {at_s:5.1f} s (step {reached:2d}{', its node had ended' if ended else ''}): "
                f"codes {sorted(codes.values())}, bit-identical {same}, {took:.0f} s; recovered {recovered}"
                f"{'; ' + ', '.join(seen) if seen else ''}")
        return ok, line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--within", type=float, default=20.0, help="the moment is drawn from [0, WITHIN) s")
    parser.add_argument("--keep", type=Path, default=Path("/tmp/drill-kill-anytime"))
    parser.add_argument("--keep-slower", type=float, default=None, metavar="S",
                        help="also keep the logs of a trial that took more than S s")
    parser.add_argument("--at", type=float, default=None, help="every trial loses its node at this moment (s)")
    parser.add_argument("--node", type=int, default=None, help="every trial loses this node (0 or 1)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    draw = random.Random(seed)
    from components.lib.tokendata import build_dataset, default_corpus

    work = Path(tempfile.mkdtemp(prefix="drill-"))
    dataset = work / "stdlib"
    build_dataset(default_corpus(), dataset, vocab_size=2048, max_bytes=2_000_000, seed=0)
    rc, out, _ = torchrun(work / "reference", dataset, *(a for a in ARGS if a not in BASE), f"--train.steps={STEPS}")
    if rc != 0:
        print(out[-4000:])
        return 1
    reference = load_model_weights(work / "reference" / "checkpoints")
    print(f"seed {seed}: {args.trials} trials, a node lost in [0, {args.within}) s", flush=True)
    failed = 0
    for i in range(args.trials):
        at_s, rank = draw.uniform(0, args.within), draw.randrange(2)
        at_s = at_s if args.at is None else args.at
        rank = rank if args.node is None else args.node
        base = work / f"trial{i}"
        began = time.monotonic()
        ok, line = trial(base, dataset, reference, at_s, rank)
        print(f"{'ok  ' if ok else 'FAIL'} {i}: {line}", flush=True)
        failed += not ok
        if not ok or (args.keep_slower is not None and time.monotonic() - began > args.keep_slower):
            keep = args.keep / f"seed{seed}-trial{i}"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(base, keep, ignore=shutil.ignore_patterns("*.distcp", "*.pt", "*-shm"))
            print(f"     logs: {keep}", flush=True)
        shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{args.trials - failed} of {args.trials} trials ended bit-identical with every node at exit 0")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
