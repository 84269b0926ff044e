"""A local rank's GPU passing from a dead worker to the next (``trainer/resiliency/device.py``), shown without a GPU:
the wait against a real process standing in for the dead worker's device memory, the need a worker records, and a
forked child that lets go of the device files it inherited when its worker dies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest

from testlib import REPO
from trainer.exitcodes import ExitCode, classify
from trainer.resiliency import device

GIB = 2**30


class HeldBy:
    """A stand-in for a killed worker's device memory: ``held`` GiB of a 80 GiB device are taken while the process
    ``pid`` lives (a dead worker's memory comes back when its last process lets go of it)."""

    def __init__(self, proc: subprocess.Popen, held: int) -> None:
        self.proc, self.held = proc, held

    def free(self) -> int:
        return 80 * GIB - (self.held if self.proc.poll() is None else 0)


def holder() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_takeover_waits_while_the_dead_workers_memory_is_held_and_goes_on_when_released(caplog):
    stand_in = HeldBy(holder(), 64 * GIB)
    try:
        killer = subprocess.Popen([sys.executable, "-c", f"import os, time, signal; time.sleep(0.6); "
                                             f"os.kill({stand_in.proc.pid}, signal.SIGKILL)"])
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="trainer.resiliency"):
            waited = device.wait_for_memory(62 * GIB, stand_in.free, bound_s=20, label="cuda:0",
                                            why="its previous worker's memory is being released")
        assert 0.5 <= waited <= time.monotonic() - began < 10
        lines = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
        assert len(lines) == 1 and "cuda:0" in lines[0] and "16.0 GiB free at first" in lines[0], lines
        assert "its previous worker's memory is being released" in lines[0]
        killer.wait(10)
    finally:
        stand_in.proc.kill()
        stand_in.proc.wait()


def test_the_wait_line_names_who_held_the_device_when_it_began(caplog):
    stand_in = HeldBy(holder(), 64 * GIB)
    seen = []
    deadline = time.monotonic() + 10
    while device.process_state(stand_in.proc.pid) != "sleeping" and time.monotonic() < deadline:
        time.sleep(0.02)  # past its interpreter's start

    def holders() -> str:
        seen.append(device.process_state(stand_in.proc.pid))
        return f"held by pid {stand_in.proc.pid} (64.0 GiB, {seen[-1]})"

    try:
        threading.Timer(0.3, stand_in.proc.kill).start()
        with caplog.at_level(logging.WARNING, logger="trainer.resiliency"):
            device.wait_for_memory(62 * GIB, stand_in.free, bound_s=20, label="cuda:0", why="released", holders=holders)
    finally:
        stand_in.proc.kill()
        stand_in.proc.wait()
    assert seen == ["sleeping"]  # asked once, when the wait began
    line = next(r.getMessage() for r in caplog.records if "waited" in r.getMessage())
    assert f"(released; at first held by pid {stand_in.proc.pid} (64.0 GiB, sleeping))" in line


def test_a_holders_state_reads_from_proc_through_its_death():
    proc = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                             "threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while device.process_state(proc.pid) != "sleeping, 2 threads" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert device.process_state(proc.pid) == "sleeping, 2 threads"
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not device.process_state(proc.pid).startswith("stopped") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert device.process_state(proc.pid) == "stopped, 2 threads"
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while device.process_state(proc.pid) != "exited" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert device.process_state(proc.pid) == "exited"  # a zombie: its parent has not reaped it yet
    finally:
        proc.kill()
        proc.wait()
    assert device.process_state(proc.pid) == "not here"
    assert device.process_state(os.getpid()) == "this process"


def test_a_device_that_has_the_memory_is_not_waited_for(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.resiliency"):
        assert device.wait_for_memory(62 * GIB, lambda: 10 * GIB, held_by_me=60 * GIB, bound_s=1) == 0.0
    assert not caplog.records  # what this process already caches counts as its own (an in-process restart)


def test_a_takeover_gives_up_at_the_bound_with_one_line_and_the_node_is_replaced():
    stand_in = HeldBy(holder(), 64 * GIB)
    try:
        with pytest.raises(device.DeviceHeld) as err:
            device.wait_for_memory(62 * GIB, stand_in.free, bound_s=0.3, label="cuda:1")
    finally:
        stand_in.proc.kill()
        stand_in.proc.wait()
    message = str(err.value)
    assert "\n" not in message and "cuda:1" in message and "resiliency.device_wait_s" in message
    assert "16.0 GiB free after 0.3 s" in message and "62.0 GiB" in message
    assert classify(err.value) == ExitCode.UNHEALTHY_NODE  # a new pod, not an in-job restart into the same wait


def test_the_need_is_written_when_the_peak_grows_and_read_by_the_successor(tmp_path, monkeypatch):
    monkeypatch.setenv(device.DEVICE_DIR_ENV, str(tmp_path))
    record = device.NeedRecord.from_environ(1)
    assert record is not None and record.read() == 0  # no predecessor: nothing to wait for
    assert record.note(40 * GIB, 80 * GIB)
    assert not record.note(40 * GIB + device.GROWTH_BYTES - 1, 80 * GIB)  # grew too little to write again
    assert record.note(50 * GIB, 80 * GIB)
    assert device.NeedRecord.from_environ(1).read() == 50 * GIB  # a new process of local rank 1 reads it
    assert device.NeedRecord.from_environ(0).read() == 0
    (tmp_path / "need-0.json").write_text("{torn")
    assert device.NeedRecord.from_environ(0).read() == 0  # unreadable: no wait rather than a crash
    monkeypatch.delenv(device.DEVICE_DIR_ENV)
    assert device.NeedRecord.from_environ(0) is None  # not under entrypoint.sh
    assert device.wait_for_predecessor(0, 1.0, "no record") == 0.0


def test_a_new_worker_waits_for_a_contexts_room_first_and_for_the_whole_need_before_its_model(tmp_path, monkeypatch):
    """The two stages of a new worker's wait: its start up to the model runs beside the release of its predecessor's
    memory (16 GiB free of 80 while 64 are held: room for a context), the model's build waits for the 60 GiB."""
    monkeypatch.setenv(device.DEVICE_DIR_ENV, str(tmp_path))
    device.NeedRecord.from_environ(0).note(60 * GIB, 80 * GIB)
    stand_in = HeldBy(holder(), 64 * GIB)
    monkeypatch.setattr(device, "nvml_free", lambda index: stand_in.free)
    try:
        assert device.wait_for_predecessor(0, 5.0, "first stage", at_most=device.CONTEXT_ROOM) == 0.0
        with pytest.raises(device.DeviceHeld, match="the job needs 60.0 GiB"):
            device.wait_for_predecessor(0, 0.3, "the model's build")
        killer = subprocess.Popen([sys.executable, "-c", f"import os, time, signal; time.sleep(0.5); "
                                             f"os.kill({stand_in.proc.pid}, signal.SIGKILL)"])
        assert device.wait_for_predecessor(0, 20.0, "the model's build") >= 0.4
        killer.wait(10)
    finally:
        stand_in.proc.kill()
        stand_in.proc.wait()


_FORKING_WORKER = """
import multiprocessing, os, sys, time
from trainer.resiliency import device

stand_in = open(sys.argv[1], "rb")  # the worker's /dev/nvidia* descriptors
device.install(prefixes=(sys.argv[1],))
ctx = multiprocessing.get_context("fork")
child = ctx.Process(target=time.sleep, args=(60,), daemon=False)  # as NVRx's in-process monitor is forked
child.start()
print(child.pid, flush=True)
os._exit(0)  # the worker dies; the child lives on
"""


def fork_and_die(tmp_path, script: str) -> tuple[Path, int]:
    """Run ``script`` (a worker that forks a long-lived child and dies) on a stand-in device file; the child's pid."""
    stand_in = tmp_path / "nvidia0"
    stand_in.write_bytes(b"\0" * 16)
    out = tmp_path / "out"
    with open(out, "w") as sink:  # the child inherits the worker's stdio: a file, not a pipe waited for
        subprocess.run([sys.executable, "-c", script, str(stand_in)], stdout=sink, stderr=subprocess.STDOUT,
                       timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "trainer_image")}, check=True)
    return stand_in, int(out.read_text().split()[0])


def test_a_child_forked_from_the_worker_does_not_outlive_it_holding_its_device_files(tmp_path):
    stand_in, child = fork_and_die(tmp_path, textwrap.dedent(_FORKING_WORKER))
    try:
        assert os.path.exists(f"/proc/{child}")  # it outlived the worker
        held = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
        assert str(stand_in) not in held and os.devnull in held, held
    finally:
        os.kill(child, signal.SIGKILL)


def test_without_the_hook_the_child_would_hold_them(tmp_path):
    """The check above can fail: a child forked without ``install`` keeps the file open."""
    script = textwrap.dedent(_FORKING_WORKER).replace("device.install(prefixes=(sys.argv[1],))", "")
    stand_in, child = fork_and_die(tmp_path, script)
    try:
        held = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
        assert str(stand_in) in held
    finally:
        os.kill(child, signal.SIGKILL)


class OutOfMemoryError(RuntimeError):
    """Named as torch's CUDA OOM (``classify`` matches class names): a CPU stand-in for one."""


def test_an_oom_before_the_models_first_step_is_exit_2_and_after_it_a_fault_to_restart(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from trainer import resiliency
    from trainer.exitcodes import TrainerExit

    def oom(res, store, layers):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setenv(device.DEVICE_DIR_ENV, str(tmp_path))
    layers = resiliency.Layers.null()
    layers.device_need = device.NeedRecord.from_environ(0)
    res = SimpleNamespace(device="cuda:0")
    with pytest.raises(TrainerExit) as err:  # no worker of this local rank ever completed a step: it never fit
        resiliency._call(oom, res, None, layers)
    assert err.value.exit_code == ExitCode.CONFIG_ERROR and "\n" not in err.value.reason
    assert "does not fit on cuda:0" in err.value.reason and "train.batch_size" in err.value.reason
    device.NeedRecord(tmp_path, 0).note(40 * GIB, 80 * GIB)  # a worker before this one ran its first step
    with pytest.raises(OutOfMemoryError) as raised:  # the in-process layer restarts it; else exit 207, in-job
        resiliency._call(oom, res, None, layers)
    assert classify(raised.value) == ExitCode.DEVICE_OUT_OF_MEMORY


@pytest.mark.parametrize("free_gib, context", [(4.0, False), (12.0, True)])
def test_a_standby_makes_its_context_only_where_the_worker_keeps_its_margin(monkeypatch, free_gib, context):
    """A warm standby's CUDA context beside a worker that fills the card would take the worker's margin for growth
    (an OOM of the worker later): with too little free, the standby says so and makes none."""
    from trainer.startup import standby
    from trainer.checkpoint.staging import STANDBY_DEVICE_BYTES, device_margin

    reading = types.SimpleNamespace(free=int(free_gib * GIB), total=80 * GIB)  # NVML's memory info, its two fields
    monkeypatch.setattr(device, "nvml_memory", lambda index: lambda: reading)
    need = STANDBY_DEVICE_BYTES + device_margin(80 * GIB)
    assert (free_gib * GIB >= need) == context  # the two cases straddle the need
    line = standby._no_room_for_a_context(0)
    if context:
        assert line == ""
    else:
        assert line == f"{free_gib:.1f} GiB free on cuda:0, a standby's context and the worker's margin need {need / GIB:.1f} GiB"
