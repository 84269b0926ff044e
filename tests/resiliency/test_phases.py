"""The phases of a (re)start (``trainer.startup.phases``) and how the ledger reports them."""

import json
import subprocess
import sys

import pytest

from testlib import REPO
from trainer.ledger import Ledger, read
from trainer.startup import phases


class FakeTime:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime(1000.0)
    monkeypatch.setattr(phases.time, "time", fake)
    return fake


def test_phases_of_a_new_process_then_of_an_in_process_restart(clock):
    start = phases.StartClock(origin=998.0)  # the process was created 2 s ago
    for phase, seconds in (("import", 0.0), ("resources", 0.5), ("layers", 0.1)):
        clock.now += seconds
        start.mark(phase)
    clock.now += 0.4
    start.entered_train()  # ends the wrapper phase
    for phase, seconds in (("process_group", 0.2), ("model", 0.3), ("restore", 1.0), ("first_step", 0.5)):
        clock.now += seconds
        start.mark(phase)
    assert start.take() == {"import": 2.0, "resources": 0.5, "layers": 0.1, "wrapper": 0.4, "process_group": 0.2,
                            "model": 0.3, "restore": 1.0, "first_step": 0.5, "total": 5.0}
    assert start.take() is None and not start.reentry, "one report per start"

    clock.now += 30.0  # training, a fault, NVRx's restart machinery
    start.entered_train()
    for phase, seconds in (("process_group", 0.1), ("model", 0.2), ("restore", 0.3), ("first_step", 0.4)):
        clock.now += seconds
        start.mark(phase)
    assert start.reentry and start.origin == pytest.approx(1033.0)
    assert start.take() == {"process_group": 0.1, "model": 0.2, "restore": 0.3, "first_step": 0.4, "total": 1.0}


def test_process_start_time_is_read_from_proc():
    """In a fresh interpreter, the process's creation lies before the first line runs, by at most its start-up."""
    code = ("import time; now = time.time(); from trainer.startup.phases import process_start_time; "
            "print(now - process_start_time())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONPATH": f"{REPO / 'trainer_image'}"}).stdout
    assert -0.02 <= float(out) < 10.0, out


def test_recovered_record_splits_the_recovery_time_into_phases(tmp_path, monkeypatch):
    fake = FakeTime(2000.0)
    monkeypatch.setattr("trainer.ledger.time.time", fake)
    Ledger(tmp_path, rank=1).fault("sigkill", 7)  # at 2000.0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    ledger = Ledger(tmp_path, rank=0, world_size=2)  # the respawned worker, created 1.5 s after the fault
    fake.now = 2004.0
    ledger.on_train_start(iteration=0, resumed_step=6, tier="node-local")
    fake.now = 2005.25  # the first step ended at 2005.0; its start's report (log lines, the collector's summary) ran on
    measured = {"import": 1.5, "resources": 0.5, "wrapper": 0.3, "restore": 0.7, "first_step": 0.5, "total": 3.5}
    ledger.on_step_end(7, {"origin": 2001.5, "end": 2005.0, "phases": measured})
    ledger.on_step_end(8, None)
    (recovered,) = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "recovered"]
    assert recovered["recovery_s"] == 5.0
    assert recovered["phases"] == {"before_start": 1.5, **measured}
    assert recovered["phases"]["before_start"] + recovered["phases"]["total"] == recovered["recovery_s"]
    json.dumps(recovered)  # plain JSON for figures.py


def test_in_process_phases_split_the_time_from_the_fault_to_the_reentry_at_each_noted_moment():
    from trainer.ledger import in_process_phases

    marks = {"left_train": 100.3, "abort_began": 100.4, "abort_ended": 101.2, "called_again": 101.9}
    split = in_process_phases(100.0, marks, 102.0)
    assert {k: round(v, 3) for k, v in split.items()} == {
        "unwind": 0.3, "detect": 0.1, "abort": 0.8, "wrapper": 0.7, "reconnect": 0.1}
    assert round(sum(split.values()), 6) == 2.0  # they add up: nothing counted twice, nothing lost
    # moments not noted (or stale: before the fault) leave their time to the next phase; "wrapper" ends at the re-entry
    stale = {"left_train": 90.0, "abort_began": 100.4, "abort_ended": 101.2}
    assert in_process_phases(100.0, stale, 102.0) == pytest.approx(
        {"detect": 0.4, "abort": 0.8, "wrapper": 0.8})


def test_unfrozen_summary_counts_what_a_full_collection_scans_and_names_packages_imported_since_the_freeze():
    code = ("import gc, sys; sys.path.insert(0, 'trainer_image'); from trainer.startup import phases; "
            "before = len(gc.get_objects()); phases.freeze_collector(); "
            "import email.mime.text; keep = [[i] for i in range(5000)]; print(before, phases.unfrozen_summary())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    before, summary = out.split(" ", 1)
    count, rest = summary.split(" objects outside the frozen set (most: ")
    kinds, packages = rest.split("); modules imported since the freeze: ")
    # the lists made after the freeze are counted; the objects that existed at the freeze are not
    assert 5000 <= int(count) < 5000 + int(before)
    assert kinds.startswith("list 50")  # the most common type first, with its count (5000 lists and a few more)
    assert "email (" in packages and "trainer (" not in packages


def test_what_a_launched_worker_imports_before_torch_imports_no_torch():
    """``python -m trainer`` hands itself over (``trainer.startup.handoff``) before anything imports torch, and
    ``trainer.cli`` starts the warm-up's compile stage (``trainer.startup.warmup``) before it imports torch: neither
    they nor the package, nor the start's phases, may import it."""
    code = ("import sys; import trainer.startup, trainer.startup.handoff, trainer.startup.phases, "
            "trainer.startup.warmup, trainer.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONPATH": f"{REPO / 'trainer_image'}"}).stdout
    assert out.strip() == "[]", out
