"""Warm standby workers (trainer/startup/standby.py, trainer/startup/handoff.py).

Unit level: a real launched process (``python -m trainer``) hands itself over through a real unix socket to a real
standby process that runs a trivial target (``standby_target.py``), or to the standby server's. End to end: a job
under ``entrypoint.sh`` with ``TRAINER_STANDBY=1`` whose SIGKILLed worker is replaced by the standbys, trains
bit-identically to a fault-free run and leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_recovery import BASE, ENTRYPOINT, FT_ENV, GRACE, VENV_BIN, _assert_nothing_left, assert_same_weights, \
    events, node_dir, torchrun
from testlib import REPO, free_port
from trainer.checkpoint import load_model_weights
from trainer.startup.handoff import import_time_mismatch

HERE = Path(__file__).parent
TARGET = "standby_target:main"


def _env(directory: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TRAINER_STANDBY_DIR": str(directory), "LOCAL_RANK": "0", "RANK": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    return {**env, **extra}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.05)


class Standby:
    """One standby process of local rank 0 (spawned as the server would, without the server)."""

    def __init__(self, directory: Path, **env: str) -> None:
        self.directory = directory
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.startup.standby", "warm", "--local-rank", "0", "--dir",
                                      str(directory), "--target", TARGET], env=_env(directory, **env), cwd=REPO,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        _wait(lambda: (directory / "standby-0.sock").exists() or self.proc.poll() is not None, "the standby's socket")
        assert self.proc.poll() is None, f"the standby exited {self.proc.returncode}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def standby(tmp_path):
    directory = tmp_path / "standby"
    directory.mkdir()
    made: list[Standby] = []

    def make(**env: str) -> Standby:
        made.append(Standby(directory, **env))
        return made[-1]

    yield make
    for s in made:
        s.close()


def launch(directory: Path, *argv: str, stdout=subprocess.PIPE, **env: str) -> subprocess.Popen:
    """The launched worker, as ft_launcher starts it (its own session)."""
    return subprocess.Popen([sys.executable, "-m", "trainer", *argv], env=_env(directory, **env), cwd=REPO,
                            stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_exit_code_and_stdout_round_trip(standby, tmp_path):
    s = standby()
    out_file = tmp_path / "stdout.txt"
    with out_file.open("w") as out:
        proxy = launch(s.directory, "exit", "7", stdout=out)
        _, err = proxy.communicate(timeout=60)
    assert proxy.returncode == 7, err
    assert f"standby worker (pid {s.proc.pid}, warm for" in err and "took over local rank 0" in err, err
    assert out_file.read_text().startswith(f"target pid {s.proc.pid} cwd {REPO} rank 0"), "stdout follows the proxy's"
    s.proc.wait(timeout=30)
    assert not (s.directory / "standby-0.sock").exists(), "a taken standby no longer listens"


def test_os_exit_reports_its_code(standby):
    s = standby()
    proxy = launch(s.directory, "os_exit", "143")
    _, err = proxy.communicate(timeout=60)
    assert proxy.returncode == 143 and "took over" in err, err


def test_a_differing_cuda_visible_devices_is_refused_and_the_proxy_runs_itself(standby):
    s = standby(CUDA_VISIBLE_DEVICES="0")
    proxy = launch(s.directory, "--help-config", CUDA_VISIBLE_DEVICES="1")
    out, err = proxy.communicate(timeout=120)
    assert proxy.returncode == 0 and "[train]" in out, err  # the trainer's own CLI, in the launched process
    assert "refused: CUDA_VISIBLE_DEVICES differs (taker: '0', worker: '1'); starting normally" in err, err
    assert "took over" not in err
    assert s.proc.poll() is None and (s.directory / "standby-0.sock").exists(), "still warm for the next one"


def test_no_standby_runs_normally(tmp_path):
    proxy = launch(tmp_path, "--help-config")  # nothing listens in tmp_path
    out, err = proxy.communicate(timeout=120)
    assert proxy.returncode == 0 and "[train]" in out and "standby" not in err, err


def test_sigterm_to_the_proxy_reaches_the_worker(standby, tmp_path):
    s = standby()
    proxy = launch(s.directory, "sleep", str(tmp_path))
    _wait(lambda: (tmp_path / "pid").exists(), "the worker's start")
    proxy.send_signal(signal.SIGTERM)
    _, err = proxy.communicate(timeout=30)
    assert proxy.returncode == 143, err
    assert (tmp_path / "sigterm").read_text() == str(s.proc.pid)


def test_kill_9_of_the_worker_kills_the_proxy_by_sigkill(standby, tmp_path):
    s = standby()
    proxy = launch(s.directory, "sleep", str(tmp_path))
    _wait(lambda: (tmp_path / "pid").exists(), "the worker's start")
    os.kill(s.proc.pid, signal.SIGKILL)
    proxy.communicate(timeout=30)
    assert proxy.returncode == -signal.SIGKILL, "ft_launcher must see a signal death"


@pytest.mark.parametrize("action", ["sleep", "hang_gil"])
def test_kill_9_of_the_proxy_kills_the_worker(standby, tmp_path, action):
    """Even a worker stuck in a C call that holds the GIL (its own threads cannot run) dies at once."""
    s = standby()
    proxy = launch(s.directory, action, str(tmp_path))
    _wait(lambda: (tmp_path / "pid").exists(), "the worker's start")
    proxy.kill()
    proxy.communicate(timeout=30)
    s.proc.wait(timeout=10)
    assert s.proc.returncode == -signal.SIGKILL


def test_the_server_warms_after_the_first_step_and_its_standby_dies_with_it(tmp_path):
    directory = tmp_path / "standby"
    directory.mkdir()
    log = tmp_path / "server.err"  # a file, read while the server runs: its lines follow a standby's socket
    with open(log, "w") as err_file:
        server = subprocess.Popen([sys.executable, "-m", "trainer.startup.standby", "serve", "--nproc", "1", "--dir",
                                   str(directory), "--target", TARGET], env=_env(directory), cwd=REPO,
                                  stderr=err_file, text=True, start_new_session=True)

    def warm_lines() -> int:
        return log.read_text().count("local rank 0: warm in")

    try:
        time.sleep(1)
        assert not (directory / "standby-0.sock").exists(), "no standby before the worker's first step"
        (directory / "first-step-0").touch()
        _wait(lambda: (directory / "standby-0.sock").exists(), "the standby's socket")
        proxy = launch(directory, "exit", "3")
        _, err = proxy.communicate(timeout=60)
        assert proxy.returncode == 3 and "took over" in err, err
        time.sleep(1)
        assert not (directory / "standby-0.sock").exists(), "no replacement before the new worker's first step"
        (directory / "first-step-0").touch()
        _wait(lambda: (directory / "standby-0.sock").exists(), "the replacement's socket")
        # the standby's socket is connectable before the server has read its "ready" and said so
        _wait(lambda: warm_lines() == 2, "the server's line for the replacement")
        warm = [p for p in map(int, Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split())]
        assert len(warm) == 1
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
        _wait(lambda: not _alive(warm[0]), "the standby's death with its server (PDEATHSIG)", timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    assert warm_lines() == 2, log.read_text()


@pytest.mark.parametrize("theirs, why", [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF differs"),
    ({"LD_PRELOAD": "/x.so"}, "LD_PRELOAD differs"),
    ({"TORCH_CPP_LOG_LEVEL": "INFO"}, "TORCH_CPP_LOG_LEVEL differs"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "RANK": "3", "OMP_NUM_THREADS": "1"}, None),
])
def test_import_time_environment(theirs, why):
    mine = {"PATH": "/bin", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    reason = import_time_mismatch(mine, {**mine, **theirs}, ["a"], ["a"])
    assert (reason is None) if why is None else (why in reason), reason
    assert "module search path" in import_time_mismatch(mine, mine, ["a"], ["b"])
    assert "OMP_NUM_THREADS is set for the taker" in import_time_mismatch({"OMP_NUM_THREADS": "4"}, {}, [], [])


# --- end to end -----------------------------------------------------------------------------------------------

E2E_STEPS = 40  # both standbys must warm (at the lowest priority, on 2 busy cores) before the kill: alone, ~4 s after
# the first step, at step ~7 (with 60 steps the run went on ~9 s after the kill; this leaves ~5 s)
UNTIL_WARM = "--resiliency.faults=0:2:slow:3.0,1:2:slow:3.0"
"""The first workers sleep 3x each timed part of their steps from step 2, which leaves most of the cores to the standbys
warming at the lowest priority however loaded the machine is (CI under other jobs' load: the run ended first). The
standbys that take over do not fire it again, and a sleep changes no arithmetic: the reference stays fault-free."""


def _e2e_args(run_dir: Path, dataset: Path) -> list[str]:
    return [*BASE, f"--train.steps={E2E_STEPS}", f"--data.path={dataset}", f"--train.run_dir={run_dir}",
            f"--checkpoint.node_local_dir={node_dir(run_dir)}"]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _environ(pid: int) -> dict[bytes, bytes]:
    return dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)


def _standby_processes(tag: str) -> list[int]:
    """Standbys (warm, or running as workers) whose command line names ``tag`` (their job's directory); forked by
    the node's fork server, they have its command line."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        forked = b"trainer.startup.forkserver" in cmdline  # the node's fork server and its children (standbys among them)
        if (b"trainer.startup.standby" in cmdline or forked) and tag.encode() in cmdline and _alive(int(entry)):
            pids.append(int(entry))
    return pids


@pytest.fixture
def job_tmp():
    """A short TMPDIR for the job (its unix sockets' paths), removed even when the test fails."""
    path = Path(tempfile.mkdtemp(prefix="sb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.multiprocess
@pytest.mark.serial
def test_sigkilled_worker_is_replaced_by_the_warm_standbys(tmp_path, tiny_dataset, job_tmp):
    """Under entrypoint.sh with TRAINER_STANDBY=1: once both standbys are warm, a worker is SIGKILLed; the
    restarted workers are the standbys, training ends bit-identical to a fault-free run, and nothing is left."""
    reference_dir = tmp_path / "reference"
    rc, out, _ = torchrun(reference_dir, tiny_dataset, f"--train.steps={E2E_STEPS}", timeout=300)
    assert rc == 0, out[-4000:]
    reference = load_model_weights(reference_dir / "checkpoints")

    run_dir = tmp_path / "run"
    port = free_port()
    env = {**os.environ, **FT_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port),
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(job_tmp), "TRAINER_STANDBY": "1"}
    shm_before = set(os.listdir("/dev/shm"))
    job = subprocess.Popen([str(ENTRYPOINT), *_e2e_args(run_dir, tiny_dataset), *GRACE, UNTIL_WARM], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        sockets = lambda: list(job_tmp.glob("trainer-job.*/standby/standby-*.sock"))  # noqa: E731
        _wait(lambda: len(sockets()) == 2 or job.poll() is not None, "both standbys warm", timeout=240)
        assert job.poll() is None, "the run ended before its standbys were warm: raise E2E_STEPS"
        launcher = next(p for p in _children(job.pid)  # ft_launcher, run by python -m trainer.resiliency.launch
                        if b"trainer.resiliency.launch" in Path(f"/proc/{p}/cmdline").read_bytes())
        own = Path(f"/proc/{launcher}/cmdline").read_bytes()  # its forked rank monitors carry it
        workers = [p for p in _children(launcher) if Path(f"/proc/{p}/cmdline").read_bytes() != own]
        victim = next(p for p in workers if _environ(p)[b"RANK"] == b"1")
        os.kill(victim, signal.SIGKILL)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    print("\n".join(line for line in out.splitlines() if "standby" in line))
    assert job.returncode == 0, out[-4000:]
    took_over = dict(re.findall(r"standby worker \(pid (\d+), warm for [\d.]+ s\) took over local rank (\d)", out))
    assert sorted(took_over.values()) == ["0", "1"], out[-4000:]
    restarts = events(run_dir, "restart")
    assert {r["layer"] for r in restarts} == {"injob"} and {str(r["pid"]) for r in restarts} == set(took_over), \
        "the restarted workers are the standbys"
    (recovered,) = events(run_dir, "recovered")
    first = [float(m) for m in re.findall(r"\[rank0\] .*start phases \(s\): import ([\d.]+)", out)]
    print(f"import phase, rank 0: first start {first[0]:.2f} s (no standby), in-job restart "
          f"{recovered['phases']['import']:.2f} s (standby); recovery {recovered['recovery_s']:.2f} s, phases "
          f"{recovered['phases']}")
    assert_same_weights(run_dir, reference)
    _assert_nothing_left(run_dir, port, shm_before)
    _wait(lambda: not _standby_processes(str(job_tmp)), "the end of every standby and standby worker", timeout=10)
    assert not list(job_tmp.iterdir()), "the job's TMPDIR (standby sockets included) is removed"


@pytest.mark.parametrize("value", ["yes", "2", "on"])
def test_entrypoint_rejects_a_bad_trainer_standby(value):
    env = {"PATH": "/usr/bin:/bin", "TRAINER_STANDBY": value}
    result = subprocess.run([str(REPO / "trainer_image" / "entrypoint.sh"), "--config", "tiny"], capture_output=True,
                            text=True, timeout=30, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"entrypoint: TRAINER_STANDBY must be True or False (1 or 0); got '{value}'"
