"""The goodput planner's inputs (``trainer.planning.costs``, ``defaults``, ``band``) and the tiers as they run
(``simulate``): an unmeasured node loss takes the documented default, not the in-job time; extra ledgers measure what
the run did not; spares are what the user asks; the peer tier's row; the ablations; Young/Daly per tier; the band."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from components.lib.params import DEFAULTS as PIPELINE_DEFAULTS
from testlib import REPO
from trainer import plan
from trainer.planning import LAYERS, failures
from trainer.planning.band import band
from trainer.planning.chart import curves
from trainer.planning.costs import from_run
from trainer.planning.defaults import DEFAULTS
from trainer.planning.ledgers import measure
from trainer.planning.recommend import served_rates, young_daly_interval
from trainer.planning.simulate import CONFIGURATIONS, Cluster, Costs, _all_holders_lost, simulate

STEP_S = 0.5


def ledger(run: Path, recovered: list[dict], *, replicas: int | None = None, snapshot_extra_s: float = 0.0,
           steps: int = 40, interval: int = 5) -> Path:
    """A run directory: ``steps`` steps of ``STEP_S`` (each snapshot's window S..S+3 slower by ``snapshot_extra_s``
    in all), ``recovered`` records, and one periodic persisted write."""
    run.mkdir(parents=True, exist_ok=True)
    records = [{"event": "start", "time": 1000.0, "rank": 0},
               {"event": "persisted", "time": 1010.0, "rank": 0, "step": 10, "at_step": 12, "write_s": 2.0},
               *({"event": "recovered", "time": 1005.0, "rank": 0, **r} for r in recovered)]
    (run / "recovery.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = {"interval": interval, "persist_every": 1, **({"replicas": replicas} if replicas is not None else {})}
    metrics = [{"event": "start", "device": "cpu", "model": "tiny", "world_size": 2, "checkpoint": settings}]
    for s in range(1, steps + 1):
        extra = snapshot_extra_s / 4 if s > interval - 1 and 0 <= s % interval < 4 else 0.0
        metrics.append({"event": "step", "step": s, "step_time_s": STEP_S + extra, "time": 1000.0 + s * STEP_S})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run


INJOB = {"layer": "injob", "recovery_s": 5.51, "tiers": {"node-local": [0, 1]},
         "phases": {"restore": 2.0}}
INPROCESS = {"layer": "inprocess", "recovery_s": 1.5, "tiers": {"memory": [0, 1]}}


def test_a_ledger_without_a_node_loss_takes_the_documented_default(tmp_path, capsys):
    run = ledger(tmp_path / "run", [INPROCESS, INJOB])
    costs = from_run(run)
    assert costs.recovery_s["injob"] == pytest.approx(5.01)
    assert costs.recovery_s["node"] == DEFAULTS["recovery_node"].value != costs.recovery_s["injob"]
    assert costs.recovery_s["cluster"] == DEFAULTS["recovery_cluster"].value
    assert costs.sources["recovery_node"]["kind"] == "default"
    assert costs.sources["recovery_injob"] == {"kind": "measured", "from": f"{run} (cpu, tiny)"}
    assert plan.main(["--run", str(run), "--gpus", "64", "--trials", "4", "--days", "1"]) == 0
    text = capsys.readouterr().out
    assert "no ledger measured a node loss" in text and "bench/peer_nodes.py --plan lost:0" in text
    node_line = next(line for line in text.splitlines() if line.strip().startswith("recovery_node"))
    assert f"{DEFAULTS['recovery_node'].value:.4g} s  default:" in node_line


def test_extra_ledgers_measure_what_the_run_did_not(tmp_path):
    """A node loss from disk and one from a peer's memory (``bench/peer_nodes.py``), a cluster restart (the demo):
    each from the ledger that measured it, less that ledger's step; the run's own measurement wins."""
    run = ledger(tmp_path / "run", [INPROCESS, INJOB])
    disk = ledger(tmp_path / "disk", [{"layer": "node", "recovery_s": 20.5, "tiers": {"node-local": [0], "disk": [1]},
                                       "phases": {"restore": 9.0}}, {**INJOB, "recovery_s": 99.0}])
    peer = ledger(tmp_path / "peer", [{"layer": "node", "recovery_s": 8.5, "tiers": {"node-local": [0], "peer": [1]}},
                                      {"layer": "cluster", "recovery_s": 40.5, "tiers": {"disk": [0, 1]}}])
    costs = from_run(run, extra=[disk, peer])
    assert costs.recovery_s["node"] == pytest.approx(20.0) and costs.peer_restore_s == pytest.approx(8.0)
    assert costs.recovery_s["cluster"] == pytest.approx(40.0) and costs.restore_persistent_s == pytest.approx(9.0)
    assert costs.recovery_s["injob"] == pytest.approx(5.01)  # the run's own, not the extra ledger's 99 s
    assert costs.sources["recovery_node"]["from"].startswith(str(disk))
    assert costs.sources["peer_restore_s"]["from"].startswith(str(peer))
    assert costs.sources["recovery_injob"]["from"].startswith(str(run))


def test_the_peer_copy_cost_is_measured_from_two_ledgers_that_differ_in_replicas(tmp_path):
    run = ledger(tmp_path / "run", [INJOB])
    off = ledger(tmp_path / "off", [], replicas=0, snapshot_extra_s=0.2)
    on = ledger(tmp_path / "on", [], replicas=1, snapshot_extra_s=0.5)
    assert from_run(run).sources["peer_copy_s"]["kind"] == "default"
    costs = from_run(run, extra=[on, off])
    assert costs.peer_copy_s == pytest.approx(0.3) and costs.sources["peer_copy_s"]["kind"] == "measured"
    pushed = ledger(tmp_path / "pushed", [INJOB], replicas=1, snapshot_extra_s=0.5)
    assert from_run(pushed).peer_copy_s == 0.0  # its own snapshot cost holds the copies


@pytest.mark.parametrize("spares", [0, 3])
def test_spares_are_what_the_user_asks_for_and_every_booked_gpu_counts(tmp_path, capsys, spares):
    run = ledger(tmp_path / "run", [INPROCESS, INJOB])
    out = tmp_path / "p.json"
    assert plan.main(["--run", str(run), "--gpus", "16384", "--spares", str(spares), "--trials", "4", "--days", "1",
                      "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["spares"] for r in result["configurations"].values()} == {spares}
    assert result["suggested_spares"] == 41  # 2 per 100 of 2,048 nodes: printed, not used
    for r in result["configurations"].values():
        assert r["goodput_per_booked_gpu"] == pytest.approx(r["goodput"] * 16384 / (16384 + 8 * spares), abs=1e-5)
    assert f"{spares} spare node(s) as asked (suggestion: 41" in capsys.readouterr().out


def node_costs(**kw) -> Costs:
    """A persistent tier far behind (a 600 s write every snapshot), a snapshot every 100 steps of 1 s."""
    return Costs(**{"step_s": 1.0, "snapshot_s": 0.5, "persist_write_s": 600.0, "interval": 100, "persist_every": 1,
                    "recovery_s": {"inprocess": 1.0, "injob": 5.0, "node": 60.0, "cluster": 60.0}, **kw})


NODE_ONLY = {"inprocess": 0.0, "injob": 0.0, "node": 24.0 / 86400, "cluster": 0.0}  # a node fault an hour


def test_the_peer_tier_is_not_below_today_when_its_copies_cost_less_than_the_work_they_save():
    """Node faults only, the persistent tier ~6 cycles behind: a replica saves ~300 steps per fault, its copies cost
    0.1 s per 100.5 s cycle. The peer row is higher, by about the redone work saved less the copies; with copies
    dearer than that work (30 s a cycle), lower."""
    cluster = Cluster(1024, spare_nodes=2)
    kw = {"days": 10, "trials": 60, "rates": NODE_ONLY}
    today = simulate(node_costs(), cluster, failures.llama3(), CONFIGURATIONS["today"], **kw)
    peer = simulate(node_costs(peer_copy_s=0.1), cluster, failures.llama3(), CONFIGURATIONS["peer"], **kw)
    saved = today.losses["redone"] - peer.losses["redone"]
    assert peer.losses["peer_copies"] < saved
    assert peer.goodput >= today.goodput + saved - peer.losses["peer_copies"] - 3 * (today.ci95 + peer.ci95)
    assert peer.goodput > today.goodput + today.ci95 + peer.ci95
    dear = simulate(node_costs(peer_copy_s=30.0), cluster, failures.llama3(), CONFIGURATIONS["peer"], **kw)
    assert dear.losses["peer_copies"] > saved and dear.goodput < today.goodput


def test_the_peer_tier_falls_back_when_a_node_and_its_replica_holder_are_lost():
    """Two nodes: a node lost before the replicas the other one lost are copied again has no replica (its holder is
    the other node) and restores from the persistent tier; among 2,048 nodes that is rare."""
    assert _all_holders_lost(np.array([0.0, 1.0, 2.0]), 1, 2).tolist() == [0.0, 1.0, 1.0]
    assert _all_holders_lost(np.array([1.0, 2.0]), 2, 2049).tolist() == [0.0, 2 / (2048 * 2047)]
    often = {"inprocess": 0.0, "injob": 0.0, "node": 200.0 / 86400, "cluster": 0.0}
    kw = {"days": 5, "trials": 40, "rates": often}
    costs = node_costs(peer_copy_s=0.1)
    two = simulate(costs, Cluster(16, spare_nodes=4), failures.llama3(), CONFIGURATIONS["peer"], **kw)
    many = simulate(costs, Cluster(16384, spare_nodes=4), failures.llama3(), CONFIGURATIONS["peer"], **kw)
    assert two.losses["redone"] > 2 * many.losses["redone"]


def test_the_ablations_differ_where_they_must():
    """Half the faults in-process, half in-job: without in-process the in-process faults take the in-job restart;
    without node-local the in-job restart reads the persistent tier (its memory restore swapped for the disk's) and
    resumes from it; without node faults the peer tier costs its copies and saves nothing. Common random numbers
    throughout."""
    rates = {"inprocess": 12.0 / 86400, "injob": 12.0 / 86400, "node": 0.0, "cluster": 0.0}
    costs = node_costs(persist_write_s=300.0, restore_memory_s=2.0, restore_persistent_s=40.0,
                       recovery_s={"inprocess": 1.0, "injob": 10.0, "node": 60.0, "cluster": 60.0})
    kw = {"days": 10, "trials": 60, "rates": rates}
    runs = {k: simulate(costs, Cluster(1024), failures.llama3(), layers, **kw) for k, layers in CONFIGURATIONS.items()}
    today, margin = runs["today"], 3 * runs["today"].ci95
    assert runs["no-inprocess"].goodput < today.goodput - margin
    assert runs["no-node-local"].goodput < runs["no-inprocess"].goodput - margin
    assert runs["peer"].goodput == pytest.approx(today.goodput - runs["peer"].losses["peer_copies"], abs=1e-3)
    free = simulate(replace(costs, peer_copy_s=0.0), Cluster(1024), failures.llama3(), CONFIGURATIONS["peer"], **kw)
    assert free.goodput == today.goodput
    assert costs.layer_recovery(CONFIGURATIONS["no-node-local"])["injob"] == 10.0 - 2.0 + 40.0
    per_fault = runs["no-node-local"].losses["recovery_injob"] / today.losses["recovery_injob"]
    assert per_fault == pytest.approx(48.0 / 10.0, rel=0.1)
    assert runs["no-inprocess"].losses["recovery_inprocess"] == 0.0
    kw["rates"] = dict(rates, inprocess=0.0)  # no in-process fault: without in-process changes nothing
    assert simulate(costs, Cluster(1024), failures.llama3(), CONFIGURATIONS["no-inprocess"], **kw).goodput == \
        simulate(costs, Cluster(1024), failures.llama3(), CONFIGURATIONS["today"], **kw).goodput


def test_young_daly_uses_the_faults_each_tier_serves():
    model = failures.llama3()
    costs = node_costs(snapshot_s=2.0)
    today, peer = CONFIGURATIONS["today"], CONFIGURATIONS["peer"]
    rates = model.layer_rates(16384)
    memory_today = rates["inprocess"] + rates["injob"]
    assert served_rates(model, 16384, today)["memory"] == pytest.approx(memory_today)
    assert young_daly_interval(costs, model, 16384, today) == round(math.sqrt(2 * 2.0 / memory_today))
    with_node = memory_today + rates["node"]  # the peer tier serves node faults from memory too; copies cost more
    assert young_daly_interval(costs, model, 16384, peer) == round(math.sqrt(2 * (2.0 + 2.0) / with_node))


def _exact_poisson(count: int) -> tuple[float, float]:
    """Garwood's interval by bisection on the Poisson tails."""
    def cdf(k: int, mu: float) -> float:
        term, total = math.exp(-mu), 0.0
        for i in range(k + 1):
            total += term
            term *= mu / (i + 1)
        return total

    def solve(f, lo: float, hi: float) -> float:
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    return (solve(lambda mu: 0.025 - (1 - cdf(count - 1, mu)), 0, 2 * count + 10),
            solve(lambda mu: cdf(count, mu) - 0.025, 0, 2 * count + 50))


@pytest.mark.parametrize("count", [10, 54, 419])
def test_the_poisson_band_matches_the_exact_interval(count):
    approx, exact = failures.poisson_interval(count), _exact_poisson(count)
    assert approx == pytest.approx(exact, rel=0.005)


def test_the_band_covers_the_rate_and_every_unmeasured_input(tmp_path):
    costs = from_run(ledger(tmp_path / "run", [INPROCESS, INJOB]))
    cluster, model = Cluster(16384, spare_nodes=2, replacement_s=350.0), failures.llama3()
    kw = {"days": 5, "trials": 30}
    base = simulate(costs, cluster, model, CONFIGURATIONS["today"], **kw).goodput
    result = band(costs, cluster, model, CONFIGURATIONS["today"], replacement_default=True, **kw)
    assert "recovery_node" in result["unmeasured_inputs"] and "replacement_s" in result["unmeasured_inputs"]
    assert "recovery_injob" not in result["unmeasured_inputs"]
    for key in ("rate", "unmeasured", "both"):
        lo, hi = result[key]["goodput"]
        assert lo < base < hi, (key, lo, base, hi)
    assert result["both"]["goodput"][0] < result["rate"]["goodput"][0]
    measured = replace(costs, sources={k: {"kind": "measured"} for k in costs.sources})
    every = band(measured, cluster, model, CONFIGURATIONS["today"], replacement_default=False, **kw)
    assert every["unmeasured"] is None


def test_the_pipelines_replacement_default_is_the_planners():
    assert PIPELINE_DEFAULTS.replacement_pod_s == DEFAULTS["replacement_s"].value


def test_every_layer_and_input_has_a_documented_default():
    assert {f"recovery_{x}" for x in LAYERS} <= set(DEFAULTS)
    assert all(d.source and d.measure for d in DEFAULTS.values())


def test_the_two_node_harness_ledgers_measure_a_node_loss_and_the_peer_tier():
    """The trainer's own records, as ``bench/peer_nodes.py`` left them (two CPU nodes; BENCHMARKS.md, "Projection at
    scale"): the start record's replica count, the summary's replica pushes, a node loss restored from a peer and one
    from disk."""
    runs = REPO / "bench" / "results" / "projection" / "cpu-2026-12-07-03bbcdc" / "cpu-peer-nodes"
    peer, disk = measure(runs / "2-lost-rauto", own=False), measure(runs / "3-lost-r0", own=False)
    assert (peer.replicas, disk.replicas) == (1, 0) and peer.replica_push_s > 0 and disk.replica_push_s is None
    assert set(peer.recoveries) == {"node_peer"} and set(disk.recoveries) == {"node"}
    assert disk.restores["persistent"] and "persistent" not in peer.restores


def test_the_chart_keeps_the_users_share_of_spares_at_every_size():
    costs = node_costs()
    data = curves(costs, Cluster(16384, spare_nodes=64), failures.llama3(), sizes=(1024, 16384), days=1, trials=4)
    assert [p["spares"] for p in data["today"]] == [4, 64]
    assert all(p["goodput_per_booked_gpu"] < p["goodput"] for p in data["peer"])
