"""Resiliency pieces without a process group: health checks with fakes, fault specs, exit codes, ledger."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.exitcodes import ExitCode, TrainerExit, classify, is_retryable
from trainer.faults import FaultInjector, FaultSpec, corrupt_newest_checkpoint, parse_faults
from trainer.health import (
    NVML_FEATURE_ENABLED,
    NVML_NVLINK_MAX_LINKS,
    THROTTLE_HW_THERMAL,
    GpuHealthCheck,
    NicHealthCheck,
    NodeHealth,
    NodeUnhealthy,
    NvLinkHealthCheck,
    node_checks,
)
from trainer.ledger import Ledger, read

REPO = Path(__file__).resolve().parents[2]


# --- health checks -----------------------------------------------------------------------------------
class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """The pynvml calls the checks make, with settable readings."""

    NVMLError = FakeNVMLError

    def __init__(self, ecc=0, pending=0, throttle=0, links=(1, 1, 0), xid=None):
        self.ecc, self.pending, self.throttle, self.links, self.xid = ecc, pending, throttle, list(links), xid
        self.link_reads = 0

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, handle, types, events):
        pass

    def nvmlEventSetWait(self, events, timeout_ms):
        if self.xid is None:
            raise FakeNVMLError("timeout")
        return type("Event", (), {"eventType": 0x8, "eventData": self.xid})()

    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter):
        return self.ecc

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        return self.pending

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self.throttle

    def nvmlDeviceGetNvLinkState(self, handle, link):
        self.link_reads += 1
        if link >= len(self.links):
            raise FakeNVMLError("not supported")
        return self.links[link]


@pytest.mark.parametrize(
    "reading, message",
    [
        (dict(ecc=3), "3 uncorrected ECC errors"),
        (dict(pending=NVML_FEATURE_ENABLED), "retired pages pending"),
        (dict(throttle=THROTTLE_HW_THERMAL), "thermal slowdown"),
        (dict(xid=79), "critical XID 79"),
    ],
)
def test_gpu_check_reports_each_symptom(reading, message):
    GpuHealthCheck(0, FakeNVML())(None)  # healthy
    with pytest.raises(NodeUnhealthy, match=message):
        GpuHealthCheck(0, FakeNVML(**reading))(None)


def test_nvlink_check_fails_when_an_active_link_goes_down():
    nvml = FakeNVML(links=(1, 1, 0))
    check = NvLinkHealthCheck(0, nvml)
    check(None)  # baseline: links 0 and 1 active, 2 unused
    nvml.links[2] = 0
    check(None)
    nvml.links[1] = 0
    with pytest.raises(NodeUnhealthy, match=r"NVLink\(s\) \[1\] went down"):
        check(None)


def test_nvlink_check_reads_only_the_baselines_links_after_the_first_check():
    nvml = FakeNVML(links=(1, 0, 1))
    check = NvLinkHealthCheck(0, nvml)
    check(None)
    assert nvml.link_reads == NVML_NVLINK_MAX_LINKS  # the baseline: every possible link
    nvml.link_reads = 0
    check(None)
    assert nvml.link_reads == 2  # links 0 and 2
    without = FakeNVML(links=())
    check = NvLinkHealthCheck(0, without)
    check(None)
    without.link_reads = 0
    check(None)
    assert without.link_reads == 0, "a GPU without NVLink: no NVML call on later checks"


def _fake_sysfs(root: Path, nics: dict, ib_ports: dict) -> Path:
    for name, (state, physical) in nics.items():
        d = root / "class" / "net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(state + "\n")
        if physical:
            (d / "device").mkdir()
    for hca, ports in ib_ports.items():
        for port, state in ports.items():
            d = root / "class" / "infiniband" / hca / "ports" / port
            d.mkdir(parents=True)
            (d / "state").write_text(state + "\n")
    return root


def test_nic_check_baseline_then_link_down(tmp_path):
    root = _fake_sysfs(tmp_path, {"eth0": ("up", True), "lo": ("unknown", False), "veth1": ("down", False)},
                       {"mlx5_0": {"1": "4: ACTIVE"}})
    check = NicHealthCheck(root)
    check(None)
    (root / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "state").write_text("1: DOWN\n")
    with pytest.raises(NodeUnhealthy, match=r"ib/mlx5_0/1"):
        check(None)


def test_nic_check_fails_at_start_without_an_active_port(tmp_path):
    root = _fake_sysfs(tmp_path, {"eth0": ("up", True)}, {"mlx5_0": {"1": "1: DOWN", "2": "1: DOWN"}})
    with pytest.raises(NodeUnhealthy, match="InfiniBand mlx5_0 has no ACTIVE port"):
        NicHealthCheck(root)(None)
    root2 = _fake_sysfs(tmp_path / "b", {"eth0": ("down", True)}, {})
    with pytest.raises(NodeUnhealthy, match="no physical NIC is up"):
        NicHealthCheck(root2)(None)


def test_checks_skip_absent_hardware(tmp_path):
    checks = node_checks(0, sysfs_root=tmp_path / "empty")  # no NVML on this machine, no sysfs entries
    assert [type(c).__name__ for c in checks] == ["NicHealthCheck"]
    checks[0](None)
    GpuHealthCheck(0, nvml=None)(None)
    NvLinkHealthCheck(0, nvml=None)(None)


def test_node_is_not_checked_twice_in_a_row_around_an_in_process_restart():
    """The Wrapper's calls (iteration, after a fault?) for: the first iteration (start check done), a fault in it,
    the restarted iteration, a fault there too, the next one. Every check after a fault runs; an entry check
    right after a check is skipped."""
    from types import SimpleNamespace

    calls = []
    health = NodeHealth([lambda state: calls.append(state.iteration) or state], checked_for=0)
    for iteration in (0, 0, 1, 1, 2):  # enter 0, fault in 0, enter 1, fault in 1, enter 2
        health(SimpleNamespace(iteration=iteration))
    assert calls == [0, 1]
    unchecked = NodeHealth([lambda state: calls.append(state.iteration) or state])
    unchecked(SimpleNamespace(iteration=0))  # no start check: the first entry is checked
    assert calls == [0, 1, 0]


# --- fault specs -------------------------------------------------------------------------------------
def test_fault_specs_parse():
    assert parse_faults(["1:5:exception", " 0:8:sigkill "]) == [FaultSpec(1, 5, "exception"), FaultSpec(0, 8, "sigkill")]
    assert parse_faults([]) == []


@pytest.mark.parametrize(
    "item, message",
    [
        ("1:5", "must look like rank:step:kind, e.g. 1:5:exception"),
        ("a:5:exception", "rank and step must be integers"),
        ("1:0:exception", "step must be >= 1"),
        ("1:5:explode", "unknown kind 'explode', kinds are"),
        ("-1:5:hang", "rank must be >= 0"),
    ],
)
def test_fault_spec_errors_say_what_to_change(item, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("tiny", ["--data.path=/d", f"--resiliency.faults={item}"])


def test_duplicate_fault_is_rejected():
    with pytest.raises(ConfigError, match="two faults for rank 1 at step 5"):
        parse_faults(["1:5:exception", "1:5:hang"])


def test_fault_fires_once_per_run_dir_marker_written_first(tmp_path):
    fired = []
    specs = parse_faults(["0:3:exception", "1:3:exception"])

    def on_fire(spec):
        fired.append(spec)
        assert (tmp_path / "faults" / spec.marker_name).exists(), "marker must exist before the fault fires"

    injector = FaultInjector(specs, tmp_path, rank=0, checkpoint_dir=tmp_path / "ckpt", on_fire=on_fire)
    injector.maybe_fire(2)
    with pytest.raises(RuntimeError, match="injected fault"):
        injector.maybe_fire(3)
    again = FaultInjector(specs, tmp_path, rank=0, checkpoint_dir=tmp_path / "ckpt")  # a restarted process
    again.maybe_fire(3)
    assert fired == [FaultSpec(0, 3, "exception")]


def test_corrupt_checkpoint_changes_newest_committed_shard(tmp_path):
    from trainer.checkpoint import MANIFEST, step_dir_name

    for step in (2, 4):
        d = tmp_path / step_dir_name(step)
        d.mkdir()
        (d / MANIFEST).write_text("{}")
        (d / "shard-00000-of-00001.pt").write_bytes(bytes(20000))
    (tmp_path / (step_dir_name(6) + ".tmp")).mkdir()  # not committed
    target = corrupt_newest_checkpoint(tmp_path)
    assert target == tmp_path / step_dir_name(4) / "shard-00000-of-00001.pt"
    assert target.read_bytes() != bytes(20000)
    assert (tmp_path / step_dir_name(2) / "shard-00000-of-00001.pt").read_bytes() == bytes(20000)


# --- config rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flavour, overrides, message",
    [
        ("tiny", ["--resiliency.inprocess=true", "--resiliency.collective_timeout_s=60",
                  "--resiliency.soft_timeout_s=30", "--resiliency.hard_timeout_s=40"],
         "collective_timeout_s (60) must be smaller than resiliency.soft_timeout_s"),
        ("1b", ["--resiliency.inprocess=true", "--resiliency.collective_timeout_s=60"],
         "collective_timeout_s (60) must be greater than resiliency.hard_timeout_s (90) on GPU/NCCL"),
        ("tiny", ["--resiliency.monitor_process_interval_s=1"], "monitor_process_interval_s (1) must be smaller than"),
        ("tiny", ["--resiliency.heartbeats=maybe"], "resiliency.heartbeats must be one of"),
        ("tiny", ["--resiliency.last_call_wait_s=-1"], "last_call_wait_s must be >= 0 and smaller than"),
        ("tiny", ["--resiliency.last_call_wait_s=30"], "smaller than resiliency.soft_timeout_s (20)"),
    ],
)
def test_resiliency_config_rules(flavour, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(flavour, ["--data.path=/d", *overrides])


def test_gpu_flavours_nest_timeouts_for_nccl():
    for flavour in ("1b", "8b"):
        load_config(flavour, ["--data.path=/d", "--resiliency.inprocess=true"])  # no error


# --- exit codes --------------------------------------------------------------------------------------
def test_exit_code_classification():
    from trainer.checkpoint import CheckpointError
    from trainer.data import ShardError
    from trainer.health import NodeUnhealthy as Unhealthy

    assert classify(ConfigError("x")) == ExitCode.CONFIG_ERROR
    assert classify(ShardError("x")) == ExitCode.DATA_ERROR
    assert classify(CheckpointError("x")) == ExitCode.CHECKPOINT_ERROR
    assert classify(ZeroDivisionError()) == ExitCode.CODE_ERROR
    assert classify(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error")) == ExitCode.RANKS_LOST
    try:
        try:
            raise Unhealthy("GPU 0: 3 uncorrected ECC errors")
        except Unhealthy as inner:
            raise RuntimeError("wrapper gave up") from inner
    except RuntimeError as outer:
        assert classify(outer) == ExitCode.UNHEALTHY_NODE
    assert classify(TrainerExit(ExitCode.PREEMPTED, "x")) == ExitCode.PREEMPTED
    permanent = [ExitCode.CODE_ERROR, ExitCode.CONFIG_ERROR, ExitCode.DATA_ERROR, ExitCode.CHECKPOINT_ERROR]
    assert all(1 <= c <= 127 and not is_retryable(c) for c in permanent)
    retryable = [ExitCode.RESTART_BUDGET_EXHAUSTED, ExitCode.UNHEALTHY_NODE, ExitCode.PREEMPTED, ExitCode.RANKS_LOST]
    assert all(is_retryable(c) for c in retryable)


def test_entrypoint_rejects_arguments_ft_launcher_would_swallow():
    result = subprocess.run([str(REPO / "trainer_image" / "entrypoint.sh"), "--config", "tiny", "--ft"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == ExitCode.CONFIG_ERROR
    assert "unsupported trainer argument '--ft'" in result.stderr
    result = subprocess.run([str(REPO / "trainer_image" / "entrypoint.sh"), "--config", "tiny"],
                            capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "FT_MAX_RESTARTS": "x"})
    assert result.returncode == ExitCode.CONFIG_ERROR and "FT_MAX_RESTARTS must be a non-negative integer" in result.stderr
    result = subprocess.run([str(REPO / "trainer_image" / "entrypoint.sh"), "--config", "tiny"],
                            capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "FT_MONITOR_INTERVAL": "0"})
    assert result.returncode == ExitCode.CONFIG_ERROR and "FT_MONITOR_INTERVAL must be a number of seconds > 0" \
        in result.stderr


# --- ledger ------------------------------------------------------------------------------------------
def test_an_injected_faults_record_is_not_fsynced_before_it_fires(tmp_path, monkeypatch):
    """The fault record's time starts the recovery clock: an fsync between it and the fault (behind a checkpoint
    write in flight) was counted as recovery time that no real fault spends. Other records stay durable."""
    import trainer.ledger as ledger_module

    synced = []
    monkeypatch.setattr(ledger_module.os, "fsync", lambda fd: synced.append(fd))
    ledger = Ledger(tmp_path, rank=0)
    ledger.fault("exception", 5)
    assert not synced and read(tmp_path / "recovery.jsonl")[0]["kind"] == "exception"
    ledger.exit(130, "terminated")
    assert len(synced) == 1


def test_ledger_records_restart_recovery_and_goodput(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"event": "step", "step": s, "step_time_s": 0.5}) + "\n"
                               for s in (1, 2, 3, 4, 3, 4, 5, 6)))
    ledger = Ledger(tmp_path, rank=0)
    ledger.on_train_start(iteration=0, resumed_step=0)
    time.sleep(0.01)  # record times are rounded to 1 ms: a summary in the start's millisecond has no wall time
    Ledger(tmp_path, rank=1).fault("exception", 5)
    ledger.on_train_start(iteration=1, resumed_step=2)
    ledger.on_step_end(3)
    ledger.on_step_end(4)
    summary = ledger.summarize(6)
    records = read(tmp_path / "recovery.jsonl")
    assert [r["event"] for r in records] == ["start", "fault", "restart", "recovered", "summary"]
    restart, recovered = records[2], records[3]
    assert restart["layer"] == "inprocess" and restart["fault"]["kind"] == "exception"
    assert recovered["steps_redone"] == 2 and recovered["step"] == 3 and recovered["recovery_s"] >= 0
    assert summary["productive_s"] == pytest.approx(3.0)  # 6 kept steps x 0.5 s, the redone 3 and 4 once
    assert summary["by_layer"] == {"inprocess": 1, "injob": 0, "node": 0, "cluster": 0}
    assert 0 < summary["goodput"]


def test_ranks_with_nothing_to_restore_are_named_none_in_the_recovery(tmp_path):
    """A node lost before the first snapshot: the survivor's rank restarts from step 0 with nothing loaded, the new
    node's too; the recovery names that ``none`` (not Python's ``None`` as a string)."""
    ledger = Ledger(tmp_path, rank=0, world_size=2)
    ledger.on_train_start(iteration=0, resumed_step=0)
    ledger.on_step_end(1)
    Ledger(tmp_path, rank=1, world_size=2).exit(137, "KILLED")
    ledger.on_train_start(iteration=0, resumed_step=0, joined=[1], tiers=[None, "peer"])
    ledger.on_step_end(1)
    (recovered,) = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "recovered"]
    assert recovered["tiers"] == {"none": [0], "peer": [1]}


def test_a_worker_that_died_before_its_loop_leaves_its_node_new_and_its_launch_unchanged(tmp_path, monkeypatch):
    """A pod whose first worker died before its loop started (a port taken: exit 203) and which its launcher started
    again is still new to the job: a relaunch's restart stays the cluster's (it was counted in-job), a replacement
    pod's the node's; and a first start whose worker could not start is still a first start, not a relaunch."""
    from trainer.exitcodes import EXIT_CODE_DIR_ENV
    from trainer.ledger import mark_started, node_joined

    monkeypatch.setenv(EXIT_CODE_DIR_ENV, str(tmp_path))
    assert node_joined(0) is True  # the pod's first worker: it dies before its loop starts
    assert node_joined(0) is True  # the one its launcher starts next
    mark_started(0)
    assert node_joined(0) is False and node_joined(1) is True  # later workers of local rank 0: in-job restarts
    monkeypatch.delenv(EXIT_CODE_DIR_ENV)
    assert node_joined(0) is None  # no entrypoint.sh: no pod to know

    first = Ledger(tmp_path / "first", rank=0, world_size=2)
    first.exit(203, "RANKS_LOST", "EADDRINUSE")  # the first worker's exit, before any loop started
    first.on_train_start(iteration=0, resumed_step=0, joined=[0, 1])
    assert [r["event"] for r in read(first.path)] == ["exit", "start"]
    relaunch = Ledger(tmp_path / "relaunch", rank=0, world_size=2)
    relaunch.write("start", world_size=2)
    relaunch.exit(202, "PREEMPTED")
    relaunch.exit(203, "RANKS_LOST", "EADDRINUSE")
    relaunch.on_train_start(iteration=0, resumed_step=0, joined=[0, 1])
    assert read(relaunch.path)[-1]["layer"] == "cluster"


# --- gloo connection scan ---------------------------------------------------------------------------------
def test_the_gloo_connection_scan_skips_a_socket_closed_by_another_thread(monkeypatch):
    """The scan lists /proc/self/fd, then wraps each socket; another thread (gloo's, a store's) may close one in
    between. Wrapping the closed fd raised EBADF inside the training function: an in-process restart no fault
    caused (seen once in three two-at-a-time runs of test_recovery)."""
    import socket as socketlib

    from trainer import parallel

    sock = socketlib.socket()
    fd, inode = sock.fileno(), os.readlink(f"/proc/self/fd/{sock.fileno()}")
    sock.close()  # closed after the listing: the race, made certain
    assert parallel._is_store_connection(fd)  # left alone, not an error
    monkeypatch.setattr(parallel, "_socket_inodes", lambda fds=None: {fd: inode})  # the listing saw it open
    monkeypatch.setattr(parallel, "_GLOO_CONNECTIONS", [(fd, inode)])
    parallel.abort_process_group()  # no error, nothing else touched
    assert parallel._GLOO_CONNECTIONS == []


def test_the_distributed_abort_times_its_two_steps_and_names_the_groups():
    """The in-process abort's torch.distributed part (NVRx's AbortTorchDistributed) logs the backends' abort and the
    groups' destruction apart, and over which groups: on an H200 that part takes from milliseconds to most of a
    second, depending on the communicators there are to tear down."""
    import torch.distributed as dist

    from trainer.resiliency import _DistributedAbort

    class Impl:
        calls = 0

        @classmethod
        def shutdown_all_process_group_backends(cls):
            cls.calls += 1
            time.sleep(0.05)

    part = _DistributedAbort(Impl)
    assert part("state") == "state" and part.detail == " (no process group)" and Impl.calls == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.new_group(backend="gloo")
        assert part("state") == "state"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("the abort left the default group initialised")
    assert Impl.calls == 1
    aborted = float(part.detail.split("backends aborted ")[1].split(" s")[0])
    assert aborted >= 0.05 and part.detail.endswith("; 2 groups: gloox1, gloox1)"), part.detail
