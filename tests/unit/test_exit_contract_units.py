"""The exit-code contract in one process: classification, the entrypoint's stop signal, one-line errors with
the traceback in the run's log, the lost rank monitor, restart causes in the ledger, evaluation's message.

The multi-process half (entrypoint + ft_launcher) is ``tests/resiliency/test_exit_contract.py``.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testlib import REPO
from trainer import exitcodes
from trainer.exitcodes import (
    ENTRYPOINT_PID_ENV,
    EXIT_CODE_DIR_ENV,
    ExitCode,
    TrainerExit,
    classify,
    code_name,
    ends_job,
    on_exit,
    record_exit,
)
from trainer.ledger import Ledger, read


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: (size, mtime_ns, sha256) - to assert nothing was deleted or changed."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_trainer(args: list[str], code: str | None = None, timeout: float = 120,
                **env_extra: str) -> subprocess.CompletedProcess:
    """``python -m trainer <args>`` in one process (no launcher); ``code`` runs first instead (a patch)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", EXIT_CODE_DIR_ENV, ENTRYPOINT_PID_ENV):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "trainer", *args] if code is None else \
        [sys.executable, "-c", code + "\nfrom trainer.cli import main\nraise SystemExit(main(sys.argv[1:]))", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


# --- classification ------------------------------------------------------------------------------------
def test_lost_rank_monitor_is_retryable_and_ends_the_job():
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClientError

    try:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError as exc:
            raise RankMonitorClientError("RankMonitorClient could not send the heartbeat") from exc
    except RankMonitorClientError as exc:
        code = classify(exc)
    assert code == ExitCode.LAUNCHER_LOST and code >= 128
    assert all(ends_job(c) for c in (ExitCode.CODE_ERROR, ExitCode.CONFIG_ERROR, ExitCode.DATA_ERROR,
                                     ExitCode.CHECKPOINT_ERROR, ExitCode.UNHEALTHY_NODE, ExitCode.LAUNCHER_LOST))
    assert not any(ends_job(c) for c in (ExitCode.OK, ExitCode.KILLED, ExitCode.TERMINATED, ExitCode.RANKS_LOST,
                                         ExitCode.PREEMPTED, ExitCode.RESTART_BUDGET_EXHAUSTED))
    assert code_name(204) == "LAUNCHER_LOST" and code_name(137) == "KILLED" and code_name(134) == "SIGNAL_6"


def test_heartbeat_to_a_missing_rank_monitor_exits_launcher_lost(tmp_path, monkeypatch):
    """The real NVRx client against a socket nobody listens on (what every in-job restart meets after the
    rank monitor was killed: ft_launcher never respawns it)."""
    from trainer.resiliency import Heartbeat

    monkeypatch.setenv("FT_RANK_MONITOR_IPC_SOCKET", str(tmp_path / "gone.socket"))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    hb = Heartbeat(floor_s=None)
    with pytest.raises(TrainerExit) as err:
        hb.start()
    assert err.value.exit_code == ExitCode.LAUNCHER_LOST
    assert "rank monitor" in err.value.reason and "\n" not in err.value.reason
    hb.stop()  # teardown after the loss: no second error


def test_learned_heartbeat_timeouts_never_undercut_the_launcher_or_the_in_process_layer():
    """NVRx learns the first heartbeat's timeout from this attempt's connect-to-first-beat time (0.71 s seen);
    the rank monitor applies it to the respawned worker, which connects before loading its checkpoint: it was
    killed while loading, and its monitor was left ABORTED (every later heartbeat refused: exit 204)."""
    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts

    from trainer.resiliency import Heartbeat

    hb = Heartbeat(floor_s=24.0)
    hb.first_beat_s = 1800.0  # ft_launcher's --ft-initial-rank-heartbeat-timeout, read at the first connect
    learned = HeartbeatTimeouts(initial=0.71, subsequent=5.66, were_calculated=True)
    assert hb._bounded(learned) == HeartbeatTimeouts(initial=1800.0, subsequent=24.0, were_calculated=True)
    generous = HeartbeatTimeouts(initial=2000.0, subsequent=40.0, were_calculated=True)
    assert hb._bounded(generous) is generous
    key = hb.client.CURRENT_TIMEOUTS_STATE_KEY  # a checkpoint written before the bound: raised when loaded
    hb.load_state_dict({key: {"heartbeat": {"initial": 0.71, "subsequent": 5.66, "were_calculated": True}}})
    assert hb.client.loaded_hb_timeouts == HeartbeatTimeouts(initial=1800.0, subsequent=24.0, were_calculated=True)


def test_a_learned_timeout_spans_several_of_a_blocking_saves_liveness_signals():
    """Fast steps (no in-process layer) taught 0.76 s, under the one-second cadence of the signals a blocking save
    sends while the disk is slow: the rank was restarted in the final save's wait. The bound keeps five of them."""
    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts

    from trainer.checkpoint.persistent import KEEPALIVE_S
    from trainer.resiliency import Heartbeat

    hb = Heartbeat(floor_s=None)
    hb.first_beat_s = 60.0
    learned = HeartbeatTimeouts(initial=60.0, subsequent=0.76, were_calculated=True)
    bounded = hb._bounded(learned)
    assert bounded.subsequent == 5 * KEEPALIVE_S and bounded.initial == 60.0


def test_record_exit_signals_the_entrypoint_only_for_job_ending_codes(tmp_path, monkeypatch):
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    # record_exit ignores SIGTERM in the process that records a job-ending code: here, pytest's. An ignored
    # SIGTERM is inherited by every later subprocess, and a shell cannot trap a signal ignored at its start
    # (entrypoint.sh then never forwards a preemption): put the disposition back.
    term = signal.getsignal(signal.SIGTERM)
    try:
        monkeypatch.setenv(EXIT_CODE_DIR_ENV, str(tmp_path))
        monkeypatch.setenv(ENTRYPOINT_PID_ENV, str(os.getpid()))
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
        heard: list[tuple[int, str]] = []
        with on_exit(lambda code, reason: heard.append((code, reason))):
            monkeypatch.setattr(exitcodes, "_ending", exitcodes._Ending())  # each record: a new process
            assert record_exit(ExitCode.TERMINATED) == ExitCode.TERMINATED
            assert got == [] and (tmp_path / "rank-1").read_text() == "2 143\n"
            monkeypatch.setattr(exitcodes, "_ending", exitcodes._Ending())
            record_exit(ExitCode.DATA_ERROR, "ShardError: missing")
        assert got == [signal.SIGUSR1] and (tmp_path / "rank-1").read_text() == "2 3\n"
        monkeypatch.setattr(exitcodes, "_ending", exitcodes._Ending())
        record_exit(ExitCode.LAUNCHER_LOST)  # listener removed with its context
        assert got == [signal.SIGUSR1] * 2
        assert heard == [(143, ""), (3, "ShardError: missing")]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGTERM, term)


def test_one_exit_per_process_the_first_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(exitcodes, "_ending", exitcodes._Ending())
    monkeypatch.setenv(EXIT_CODE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ENTRYPOINT_PID_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    heard: list[int] = []
    with on_exit(lambda code, reason: heard.append(code)):
        assert record_exit(ExitCode.RANKS_LOST, "peer gone") == ExitCode.RANKS_LOST
        assert record_exit(ExitCode.TERMINATED) == ExitCode.RANKS_LOST
    assert heard == [ExitCode.RANKS_LOST] and (tmp_path / "rank-0").read_text() == "0 203\n"


def test_a_second_way_out_returns_only_once_the_first_has_written_the_code(tmp_path, monkeypatch):
    """ft_launcher's SIGTERM is read by the watch thread and by the main thread's handler at once: the one that comes
    second ends the process, which must not happen before the first has written the rank's code."""
    import threading

    monkeypatch.setattr(exitcodes, "_ending", exitcodes._Ending())
    monkeypatch.setenv(EXIT_CODE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ENTRYPOINT_PID_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("RANK", "1")
    recording = threading.Event()
    with on_exit(lambda code, reason: (recording.set(), time.sleep(0.5))):
        first = threading.Thread(target=record_exit, args=(ExitCode.TERMINATED,))
        first.start()
        assert recording.wait(10)
        assert record_exit(ExitCode.TERMINATED) == ExitCode.TERMINATED
        assert (tmp_path / "rank-1").read_text() == "0 143\n"
        first.join(10)


_SIGTERM_AFTER_EXIT = """
import os, signal, sys, time
from trainer.exitcodes import ExitCode, on_exit, record_exit
from trainer.ledger import Ledger
from trainer.resiliency import Preemption

ledger = Ledger(sys.argv[1], 1)
Preemption(grace_s=30).install()
with on_exit(lambda code, reason: ledger.exit(code, "X", reason)):
    if sys.argv[2] == "during":  # ft_launcher's SIGTERM (twice) while the exit is being recorded
        ledger.write = (lambda write: lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM),
                                                       os.kill(os.getpid(), signal.SIGTERM), write(*a, **k))[-1])(ledger.write)
    code = record_exit(ExitCode.RANKS_LOST, "peer gone")
os.kill(os.getpid(), signal.SIGTERM)  # "after": the launcher stops the group while this process tears down
time.sleep(30)
"""


@pytest.mark.parametrize("when", ["during", "after"])
def test_sigterm_while_a_worker_exits_keeps_its_code_and_one_ledger_record(tmp_path, when):
    """A worker ending on its own error meets ft_launcher's SIGTERM (once or twice) while it records that
    exit or tears down: one exit in the ledger, and the process ends with the code it recorded."""
    exit_dir = tmp_path / "exits"
    exit_dir.mkdir()
    env = {**os.environ, EXIT_CODE_DIR_ENV: str(exit_dir), "RANK": "1"}
    env.pop(ENTRYPOINT_PID_ENV, None)
    result = subprocess.run([sys.executable, "-c", _SIGTERM_AFTER_EXIT, str(tmp_path / "run"), when],
                            capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert result.returncode == ExitCode.RANKS_LOST, result.stderr
    exits = [r for r in read(tmp_path / "run" / "recovery.jsonl") if r["event"] == "exit"]
    assert [r["code"] for r in exits] == [ExitCode.RANKS_LOST]
    assert (exit_dir / "rank-1").read_text() == "0 203\n"


_STOPPED_IN_A_STORE_WAIT = """
import datetime, sys
import torch.distributed as dist
from trainer.resiliency import Preemption
from trainer.resiliency.launch import free_port

Preemption(grace_s=30).install()
store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 2, True, timeout=datetime.timedelta(seconds=60),
                      wait_for_workers=False)
print("waiting", flush=True)
store.get("rank-1-never-comes")  # in C++ for 60 s: a rank 0 whose peer's node was lost during their start
"""


def test_a_worker_stopped_for_an_in_job_restart_exits_at_once_even_blocked_in_a_store_wait(tmp_path):
    """ft_launcher's SIGTERM (no preemption marker) reaches a worker whose main thread waits in C++ for a rank that
    died: it exits TERMINATED at once, not after the launcher's --term-timeout and SIGKILL (a Python handler runs only
    when the call returns)."""
    exit_dir = tmp_path / "exits"
    exit_dir.mkdir()
    env = {**os.environ, EXIT_CODE_DIR_ENV: str(exit_dir), "RANK": "0"}
    env.pop(ENTRYPOINT_PID_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_IN_A_STORE_WAIT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "waiting", proc.stderr.read()
        time.sleep(0.5)  # inside the store's get
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        code = proc.wait(timeout=30)
        took = time.monotonic() - began
    finally:
        proc.kill()
    assert code == ExitCode.TERMINATED and took < 10, (code, took, proc.stderr.read()[-2000:])
    assert (exit_dir / "rank-0").read_text() == f"0 {int(ExitCode.TERMINATED)}\n"


_A_FORKED_CHILD_GETS_SIGTERM = """
import os, signal, time
from trainer.resiliency import Preemption

Preemption(grace_s=30).install()
pid = os.fork()  # as NVRx's in-process monitor is forked from the worker
if pid == 0:
    signal.signal(signal.SIGTERM, lambda *args: None)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(1)
print("alive", flush=True)
"""


def test_a_sigterm_to_a_child_forked_from_the_worker_does_not_stop_the_worker(tmp_path):
    exit_dir = tmp_path / "exits"
    exit_dir.mkdir()
    env = {**os.environ, EXIT_CODE_DIR_ENV: str(exit_dir), "RANK": "0"}
    env.pop(ENTRYPOINT_PID_ENV, None)
    result = subprocess.run([sys.executable, "-c", _A_FORKED_CHILD_GETS_SIGTERM], capture_output=True, text=True,
                            timeout=60, env=env, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip() == "alive", result.stderr[-2000:]
    assert not (exit_dir / "rank-0").exists()


# --- one line on stderr, the traceback in the run's log --------------------------------------------------
def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "exit " in line and "(" in line or "config error:" in line]


def test_data_error_at_start_is_one_line_and_the_traceback_is_in_the_log(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train-00000.bin").write_bytes(b"\0" * 64)  # shards without a manifest: an incomplete dataset
    before = snapshot(data)
    run_dir = tmp_path / "run"
    result = run_trainer(["--config", "tiny", f"--data.path={data}", f"--train.run_dir={run_dir}"])
    assert result.returncode == ExitCode.DATA_ERROR, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "exit 3 (DATA_ERROR): ShardError:" in lines[0] and "re-run data prep" in lines[0]
    assert result.stderr.splitlines() == lines, "nothing else on stderr (pynvml's deprecation warning included)"
    assert "Traceback" not in result.stderr + result.stdout
    log_text = (run_dir / "logs" / "trainer-rank0.log").read_text()
    assert "exit 3 (DATA_ERROR)" in log_text and "Traceback (most recent call last)" in log_text
    assert snapshot(data) == before
    assert [(r["event"], r["code"], r["name"]) for r in read(run_dir / "recovery.jsonl")] == [("exit", 3, "DATA_ERROR")]


def test_checkpoint_error_in_training_is_one_line(tmp_path, tiny_dataset):
    source = tmp_path / "warm"
    (source / "step-00000004.tmp").mkdir(parents=True)  # an unfinished save: nothing to warm-start from
    (source / "step-00000004.tmp" / "rank-00000.pt").write_bytes(b"partial")
    before = snapshot(tmp_path)
    run_dir = tmp_path / "run"
    result = run_trainer(["--config", "tiny", f"--data.path={tiny_dataset}", f"--train.run_dir={run_dir}",
                          f"--checkpoint.init_from={source}", "--train.steps=2"])
    assert result.returncode == ExitCode.CHECKPOINT_ERROR, result.stderr[-3000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "exit 4 (CHECKPOINT_ERROR): CheckpointError:" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert "Traceback (most recent call last)" in (run_dir / "logs" / "trainer-rank0.log").read_text()
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("run")} == before


def test_config_error_found_after_parsing_is_one_line(tmp_path, tiny_dataset):
    result = run_trainer(["--config", "tiny", f"--data.path={tiny_dataset}", f"--train.run_dir={tmp_path / 'run'}",
                          "--model.vocab_size=16"])
    assert result.returncode == ExitCode.CONFIG_ERROR
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "config error: model.vocab_size (16) is smaller" in lines[0]
    assert "Traceback" not in result.stderr


def test_a_node_range_that_cannot_keep_the_global_batch_is_refused_at_start(tmp_path, tiny_dataset):
    """entrypoint.sh's TRAINER_NODE_RANGE (min_nodes): a size of the range that cannot split the global batch into
    whole micro-batches is one line and exit 2 before anything is built, naming what would."""
    result = run_trainer(["--config", "tiny", f"--data.path={tiny_dataset}", f"--train.run_dir={tmp_path / 'run'}",
                          "--train.batch_size=2"], TRAINER_NODE_RANGE="3:4")
    assert result.returncode == ExitCode.CONFIG_ERROR, result.stderr[-2000:]
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and "train.global_batch=8 cannot be kept on 3 node(s)" in lines[0]
    assert "a multiple of 24 (e.g. 24), or at least 4 as the fewest nodes (min_nodes)" in lines[0]


def test_run_dir_that_is_a_file_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    result = run_trainer(["--config", "tiny", f"--data.path={tmp_path}", f"--train.run_dir={tmp_path / 'run'}"])
    assert result.returncode == ExitCode.CONFIG_ERROR
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("config error: train.run_dir: cannot write the log")
    assert "Traceback" not in result.stderr and (tmp_path / "run").read_text() == "not a directory"


def test_code_error_keeps_its_traceback_on_stderr_and_in_the_log(tmp_path, tiny_dataset):
    patch = textwrap.dedent("""
        import sys
        import trainer.train
        def broken(cfg, env=None):
            raise ValueError("a bug")
        trainer.train.Resources.create = broken
    """)
    run_dir = tmp_path / "run"
    result = run_trainer(["--config", "tiny", f"--data.path={tiny_dataset}", f"--train.run_dir={run_dir}"], code=patch)
    assert result.returncode == ExitCode.CODE_ERROR
    assert "exit 1 (CODE_ERROR): ValueError: a bug" in result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "Traceback (most recent call last)" in (run_dir / "logs" / "trainer-rank0.log").read_text()


# --- the ledger names every restart's cause -----------------------------------------------------------------
def _restart(tmp_path, monkeypatch, attempt, rank=0, iteration=0, world_size=2):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    ledger = Ledger(tmp_path, rank, world_size)
    ledger.on_train_start(iteration, resumed_step=4)
    return ledger, [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "restart"][-1]


def test_injob_restart_after_an_uninjected_kill_names_the_killed_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    Ledger(tmp_path, 0, 2).on_train_start(0, 0)
    Ledger(tmp_path, 0, 2).exit(ExitCode.TERMINATED, "TERMINATED", "SIGTERM from ft_launcher")  # rank 1: nothing
    ledger, restart = _restart(tmp_path, monkeypatch, attempt=1)
    fault = restart["fault"]
    assert restart["layer"] == "injob" and fault["kind"] == "killed" and fault["step"] is None
    assert "rank 1: no exit recorded" in fault["detail"] and "rank 0: exit 143 (TERMINATED)" in fault["detail"]
    ledger.on_step_end(5)
    recovered = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "recovered"][0]
    assert recovered["fault_kind"] == "killed" and recovered["steps_redone"] is None and recovered["recovery_s"] >= 0


def test_a_lost_nodes_fault_step_is_the_step_the_others_stopped_in(tmp_path, monkeypatch):
    """A node lost (no fault injected, its ranks record nothing): the survivors' exits say the step they were in when
    their launcher stopped them, so the recovery counts the steps redone (fault step - 1 - resumed step)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    Ledger(tmp_path, 0, 2).on_train_start(0, 0)
    survivor = Ledger(tmp_path, 0, 2)
    for step in range(1, 10):
        survivor.on_step_end(step)
    survivor.exit(ExitCode.TERMINATED, "TERMINATED", "SIGTERM from ft_launcher")  # in step 10; rank 1 lost
    ledger, restart = _restart(tmp_path, monkeypatch, attempt=1)  # resumed from step 4
    assert restart["fault"]["kind"] == "killed" and restart["fault"]["step"] == 10
    ledger.on_step_end(5)
    recovered = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "recovered"][0]
    assert recovered["fault_step"] == 10 and recovered["steps_redone"] == 5


def test_injob_restart_names_the_first_code_that_is_not_a_stopped_peer(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    Ledger(tmp_path, 0, 2).on_train_start(0, 0)
    Ledger(tmp_path, 0, 2).exit(ExitCode.TERMINATED, "TERMINATED")
    Ledger(tmp_path, 1, 2).exit(ExitCode.RANKS_LOST, "RANKS_LOST", "gloo: connection closed by peer")
    _, restart = _restart(tmp_path, monkeypatch, attempt=1, rank=1)
    assert restart["fault"]["kind"] == "ranks_lost" and restart["fault"]["time"] is not None
    # the next attempt only looks at exits after this rank's last restart: none -> both ranks "killed"
    _, again = _restart(tmp_path, monkeypatch, attempt=2, rank=1)
    assert again["fault"]["kind"] == "killed" and again["fault"]["time"] is None


def test_inprocess_restart_names_the_exception_the_wrapper_caught(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    ledger = Ledger(tmp_path, 0, 2)
    ledger.on_train_start(0, 0)
    ledger.note_exception(RuntimeError("boom"))
    ledger.on_train_start(1, 2)
    peer = Ledger(tmp_path, 1, 2)
    peer.on_train_start(1, 2)  # nothing caught on this rank: another rank failed
    restarts = [r for r in read(tmp_path / "recovery.jsonl") if r["event"] == "restart"]
    assert [(r["rank"], r["fault"]["kind"]) for r in restarts] == [(0, "exception"), (1, "peer_fault")]
    assert restarts[0]["fault"]["detail"] == "RuntimeError: boom"
    assert all(r["fault"] is not None for r in restarts)


# --- evaluation of a directory holding only an unfinished save -------------------------------------------
def test_evaluate_without_a_committed_checkpoint_says_why_in_one_line(tmp_path, capsys):
    from trainer.evaluate import main

    ckpt = tmp_path / "checkpoints"
    (ckpt / "step-00000004.tmp").mkdir(parents=True)
    (ckpt / "step-00000004.tmp" / "rank-00000.pt").write_bytes(b"partial")
    before = snapshot(ckpt)
    code = main(["--checkpoint-dir", str(ckpt), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert code == ExitCode.CHECKPOINT_ERROR
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "step-00000004.tmp" in lines[0] and "a save that never finished" in lines[0]
    assert "see the warnings above" not in err and "Traceback" not in err
    assert snapshot(ckpt) == before and not (tmp_path / "o.json").exists()


# --- the local backend: a permanent exit is one launch; every launch's TMPDIR is removed ---------------------
def test_local_backend_relaunches_launcher_lost_stops_on_permanent_and_removes_each_tmpdir(tmp_path):
    from components.lib.local_launcher import LocalJobSpec, LocalLauncher, PermanentFailure

    entry = tmp_path / "entrypoint.sh"
    entry.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        tmp = Path(os.environ["TMPDIR"])
        (tmp / "pymp-left").mkdir()  # what a killed worker leaves behind
        (tmp / "torchelastic_left").mkdir()
        with open({str(tmp_path / 'tmpdirs')!r}, "a") as f:
            f.write(str(tmp) + "\\n")
        n = len(open({str(tmp_path / 'tmpdirs')!r}).read().splitlines())
        sys.exit({int(ExitCode.LAUNCHER_LOST)} if n == 1 else {int(ExitCode.DATA_ERROR)})
    """))
    entry.chmod(0o755)
    out = io.StringIO()
    with pytest.raises(PermanentFailure) as err:
        LocalLauncher(out).run(LocalJobSpec(args=["--config", "tiny"], entrypoint=entry, state_dir=tmp_path / "state",
                                            max_cluster_restarts=5, relaunch_delay_s=0))
    tmpdirs = (tmp_path / "tmpdirs").read_text().split()
    assert len(tmpdirs) == 2 and tmpdirs[0] != tmpdirs[1], "one launch per exit: 204 relaunched, 3 not"
    assert "exit 204 (LAUNCHER_LOST) is retryable: relaunching" in out.getvalue()
    assert err.value.exit_code == ExitCode.DATA_ERROR and "3 (DATA_ERROR)" in str(err.value)
    assert not any(Path(t).exists() for t in tmpdirs)


def test_heartbeat_timeouts_are_learned_at_the_second_save_then_every_tenth_and_logged_when_they_change(caplog):
    """NVRx's calculation all-reduces on the training group and reads the result back (three host syncs): not at
    every snapshot (every 10 steps on the GPU flavours), and one INFO line per change, not per save."""
    import logging

    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts

    from trainer.resiliency import Heartbeat

    class Client:  # the calculation's inputs need a live rank monitor; what is checked here is when it is asked
        def __init__(self) -> None:
            self.calls, self.hb_timeouts = 0, None

        def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool) -> bool:
            self.calls += 1
            self.hb_timeouts = HeartbeatTimeouts(initial=1800.0, subsequent=30.0 + self.calls // 3, were_calculated=True)
            return True

    hb = Heartbeat(floor_s=None)
    hb.first_beat_s, hb.client = 0.0, Client()
    asked_at = []
    with caplog.at_level(logging.INFO, logger="trainer.resiliency"):
        for save in range(1, 43):
            before = hb.client.calls
            hb.on_save()
            if hb.client.calls > before:
                asked_at.append(save)
    assert asked_at == [2, 12, 22, 32, 42]
    logged = [r.getMessage() for r in caplog.records if "in-job heartbeat timeouts" in r.getMessage()]
    assert len(logged) == 2, logged  # subsequent 30 (calls 1-2), then 31 (calls 3-5)


def test_one_rank_learns_heartbeat_timeouts_without_a_collective(monkeypatch):
    """NVRx's timeout calculator all-reduces on the default group even with one rank: on NCCL that makes a one-rank
    communicator, which every in-process abort after it tears down (most of a second on an H200)."""
    import torch.distributed as dist
    from nvidia_resiliency_ext.fault_tolerance.timeouts_calc import TimeoutsCalc

    from trainer.resiliency import Heartbeat

    hb = Heartbeat(floor_s=None)
    calc = hb.client.timeouts_calc = TimeoutsCalc(sections=[], safety_factor=5.0)
    calc.update_on_heartbeat()
    calc.update_on_heartbeat()

    def calculate(skip_if_not_ready: bool) -> bool:  # RankMonitorClient's, without its rank monitor connection
        calc.synchronize_all()
        return False

    monkeypatch.setattr(hb.client, "calculate_and_set_hb_timeouts", calculate)
    reduced: list = []
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: reduced.append(args))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(3):  # the timeouts are learned at the second save
            hb.on_save()
    finally:
        dist.destroy_process_group()
    assert hb.saves == 3 and reduced == []
