"""The goodput planner (``trainer.planning``, ``python -m trainer.plan``): the simulation against closed forms, the
replay of a recorded CPU demo run against its measured goodput, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from testlib import REPO
from trainer import plan
from trainer.planning import LAYERS, failures
from trainer.planning.chart import curves, draw
from trainer.planning.costs import from_figures, from_run
from trainer.planning.replay import replay, replay_figures
from trainer.planning.simulate import (
    CONFIGURATIONS, Cluster, Costs, Layers, closed_form_goodput, persist_cycles, simulate, young_daly,
)

DATA = Path(__file__).parent / "planner_data"
DEMO_RUN = DATA / "demo-run"
DEMO_SETTINGS = {"interval": 10, "persist_every": 1}  # the demo's (its metrics predate the start record's: README)
ONE_LAYER = {"inprocess": 1.0 / 86400, "injob": 0.0, "node": 0.0, "cluster": 0.0}  # one fault a day


def one_layer_costs(interval: int, snapshot_s: float = 10.0, recovery_s: float = 60.0) -> Costs:
    return Costs(step_s=1.0, snapshot_s=snapshot_s, persist_write_s=0.0, interval=interval, persist_every=0,
                 recovery_s={layer: recovery_s for layer in LAYERS})


def run_one_layer(interval: int, trials: int = 300, days: float = 60.0):
    return simulate(one_layer_costs(interval), Cluster(8), failures.llama3(), Layers("one layer"), days=days,
                    trials=trials, rates=ONE_LAYER)


def test_llama3_model_uses_table_5_counts():
    model = failures.llama3()
    counts = {name: count for name, count, _ in failures.LLAMA3_TABLE5}
    assert sum(counts.values()) == 419 and counts["Faulty GPU"] == 148
    assert round(148 / 419, 3) == 0.353  # the count's share; the paper prints 30.1 %
    assert model.mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)  # one interruption every 3.09 h
    assert failures.rsc("rsc1").per_gpu_hour() == pytest.approx(6.50 / 1000 / (8 * 24))


def test_one_layer_simulation_matches_the_exact_closed_form():
    """Poisson faults, one layer, restart from the last snapshot, faults also during snapshots and recoveries: the
    renewal argument's exact goodput (``closed_form_goodput``) lies within the simulation's 95 % interval."""
    rate, snapshot_s, recovery_s = ONE_LAYER["inprocess"], 10.0, 60.0
    for interval in (600, 1315, 4000):
        result = run_one_layer(interval)
        exact = closed_form_goodput(rate, interval, snapshot_s, recovery_s)
        assert abs(result.goodput - exact) <= result.ci95, (interval, result.goodput, exact, result.ci95)
        assert sum(result.losses.values()) + result.goodput == pytest.approx(1.0)  # every second accounted for


def test_simulation_finds_young_dalys_optimum_and_loss():
    """With the same random faults at every interval, the best of Young/Daly's interval x 0.5..2 is Young/Daly's own,
    and the loss there is Young/Daly's first-order loss within the interval plus its neglected second-order term
    (rate x interval)^2."""
    rate, snapshot_s, recovery_s = ONE_LAYER["inprocess"], 10.0, 60.0
    best_s, loss = young_daly(rate, snapshot_s, recovery_s)
    results = {f: run_one_layer(round(best_s * f), trials=200) for f in (0.5, 0.71, 1.0, 1.41, 2.0)}
    assert max(results, key=lambda f: results[f].goodput) == 1.0
    at_best = results[1.0]
    assert abs((1 - at_best.goodput) - loss) <= at_best.ci95 + (rate * best_s) ** 2


def test_replay_of_the_cpu_demo_predicts_its_measured_goodput():
    """The shipped demo run (``pipelines.demo``: an exception, a SIGKILL, a lost node, a preemption with a pipeline
    retry; trimmed): its own faults and measured costs predict the goodput its ledger measured within 1.5 points."""
    result = replay(DEMO_RUN, from_run(DEMO_RUN, DEMO_SETTINGS))
    assert {f["layer"] for f in result["faults"]} >= {"inprocess", "injob", "node"}
    assert abs(result["difference_points"]) <= 1.5, result


def test_a_slow_persistent_write_is_not_free():
    """The persisted write takes its time and slows the steps: persist_every=1 no longer wins by default, and a write
    longer than the persist cadence stretches it (the persistent tier falls behind)."""
    costs = Costs(step_s=1.0, snapshot_s=0.5, persist_write_s=45.0, persist_overhead_s=5.0, interval=10,
                  persist_every=1, recovery_s={"inprocess": 5.0, "injob": 10.0, "node": 60.0, "cluster": 300.0})
    assert persist_cycles(costs, 10, 1, 0.5) == 5  # a 45 s write outlasts 4 cycles of 10.5 s
    cluster, model = Cluster(4096, spare_nodes=4), failures.llama3()

    def goodput(c: Costs, every: int) -> float:
        return simulate(c, cluster, model, CONFIGURATIONS["today"], persist_every=every, days=10, trials=60).goodput

    assert goodput(costs, 8) > goodput(costs, 1) + 0.01
    free = replace(costs, persist_write_s=0.0, persist_overhead_s=0.0)  # the lost version's assumption
    assert goodput(free, 1) > goodput(free, 8)


@pytest.mark.parametrize("run", ["h200-2026-12-04-20cd5dd", "h200-2026-12-04-69ff96c"])
def test_replay_of_the_gpu_goodput_runs(run):
    """The goodput runs of BENCHMARKS.md, "Goodput" (one H200: an exception at step 405, a SIGKILL at 805, 1,200 steps
    of ``1b``, a snapshot every 10 steps): their figure lines' costs and faults predict their strict goodput within
    1.5 points."""
    path = REPO / "bench" / "results" / "goodput" / run / "figures.jsonl"
    costs = from_figures(path, {"interval": 10, "persist_every": 20})
    result = replay_figures(path, costs)
    assert [f["steps_redone_predicted"] for f in result["faults"]] == [4, 4]  # as recorded
    assert abs(result["difference_points"]) <= 1.5, result


def test_configurations_and_chart(tmp_path):
    costs = Costs(step_s=0.3, snapshot_s=0.02, persist_write_s=10.0, interval=10, persist_every=20,
                  recovery_s={"inprocess": 1.0, "injob": 2.0, "node": 30.0, "cluster": 630.0})
    data = curves(costs, Cluster(16384, spare_nodes=2), failures.llama3(), sizes=(8, 1024, 16384), days=5, trials=16)
    assert set(data) == set(CONFIGURATIONS) and all(len(points) == 3 for points in data.values())
    assert data["today"][0]["goodput"] > data["today"][-1]["goodput"]  # more GPUs, more faults
    png = draw(data, tmp_path / "g.png", "test")
    assert Image.open(png).size == (900, 540)


def write_ledger(run: Path, records: list[dict], steps: int = 40) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "recovery.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = [{"event": "start", "device": "cpu", "checkpoint": {"interval": 5, "persist_every": 1}}]
    metrics += [{"event": "step", "step": s, "step_time_s": 0.1, "time": 1000.0 + s / 10} for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run


@pytest.mark.parametrize("case, args, expected", [
    ("no recovery", ["--run", "{run}"], "has no recovery"),
    ("negative rate", ["--costs", "{costs}", "--failure-model", "{neg}"], "per_gpu_hour\" must be a number >= 0"),
    ("missing rate", ["--costs", "{costs}", "--failure-model", "{missing}"], "per_gpu_hour\" is missing"),
    ("smaller than a node", ["--costs", "{costs}", "--gpus", "4"], "smaller than one node"),
    ("negative cost", ["--costs", "{costs}", "--cost", "snapshot_s=-1"], "snapshot_s must be a number of seconds >= 0"),
    ("unknown cost", ["--run", "{run}", "--cost", "recovery_nod=5"], "--cost recovery_nod: not an input"),
    ("missing extra ledger", ["--run", "{run}", "--measured", "{run}/x"], "x/recovery.jsonl does not exist"),
    ("negative spares", ["--costs", "{costs}", "--spares", "-1"], "--spares must be >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, args, expected):
    run = write_ledger(tmp_path / "run", [{"event": "start", "time": 1000.0, "rank": 0}])
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"step_s": 0.3, "snapshot_s": 0.02, "persist_write_s": 10.0,
                                 "recovery_s": {layer: 1.0 for layer in LAYERS}}))
    neg, missing = tmp_path / "neg.json", tmp_path / "missing.json"
    neg.write_text(json.dumps({"classes": [{"name": "GPU", "layer": "node", "per_gpu_hour": -1e-5}]}))
    missing.write_text(json.dumps({"classes": [{"name": "GPU", "layer": "node"}]}))
    argv = [a.format(run=run, costs=costs, neg=neg, missing=missing) for a in args]
    assert plan.main([*argv, "--trials", "4", "--days", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def test_the_cli_runs_without_torch(tmp_path):
    """``components`` runs the planner as a subprocess; it must not import torch (fast, and no GPU stack)."""
    probe = ("import sys, runpy; sys.argv = ['plan'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('trainer.plan', run_name='__main__')\nexcept SystemExit as e:\n"
             "    assert 'torch' not in sys.modules, 'torch imported'; raise")
    out = subprocess.run([sys.executable, "-c", probe, "--run", str(DEMO_RUN), "--cost", "interval=10", "--cost",
                          "persist_every=1", "--gpus", "1024", "--trials", "8",
                          "--days", "2", "--replay", "--json", str(tmp_path / "p.json")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "p.json").read_text())
    assert set(result["configurations"]) == set(CONFIGURATIONS)
    assert 0 < result["configurations"]["today"]["goodput"] <= 1 and "replay" in result
    assert math.isfinite(result["replay"]["predicted_goodput"])
