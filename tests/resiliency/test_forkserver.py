"""The node's fork server (trainer/startup/forkserver.py): workers and checkpoint writers forked from one process that
imported torch, NVRx and the trainer.

Unit level: a real server process (``python -m trainer.startup.forkserver serve``, its workers running the test target
``standby_target.py``) and real launched processes (``python -m trainer``) that hand themselves over to it through
the standby's path (``trainer/startup/handoff.py``); ``trainer.startup.forkserver.Process`` children (how
checkpoint writers are started). End to end, every job under ``entrypoint.sh`` runs through it (on by default): ``test_recovery.py``'s
SIGKILL and OOM kill checks that every worker and writer of every attempt came from it (``assert_forked``), and the
two-node tests (``test_nodes.py``) lose a node and finish bit-equal through it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_standby import TARGET, _alive, _env, _wait, launch
from testlib import REPO
from trainer.startup import forkserver

HERE = Path(__file__).parent


class Server:
    """One fork server (as ``entrypoint.sh`` starts it), its workers running ``standby_target``."""

    def __init__(self, directory: Path, **env: str) -> None:
        self.directory = directory
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.startup.forkserver", "serve", "--dir", str(directory),
                                      "--target", TARGET], env=self.env(**env), cwd=REPO,
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        _wait(lambda: (directory / "forkserver.sock").exists() or self.proc.poll() is not None, "the server's socket",
              timeout=180)
        assert self.proc.poll() is None, f"the server exited {self.proc.returncode}: {self.proc.stderr.read()}"

    def env(self, **extra: str) -> dict[str, str]:
        env = _env(self.directory, **extra)
        env.pop("TRAINER_STANDBY_DIR")
        return {**env, "TRAINER_FORKSERVER_DIR": str(self.directory)}

    def launch(self, *argv: str, **kw) -> subprocess.Popen:
        env = {**self.env(), "TRAINER_FORKSERVER_PID": str(self.proc.pid), **kw.pop("env", {})}
        return subprocess.Popen([sys.executable, "-m", "trainer", *argv], env=env,
                                cwd=REPO, stdout=kw.pop("stdout", subprocess.PIPE), stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate()
        return err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's unit tests: its imports are paid once, as on a node."""
    directory = tmp_path_factory.mktemp("forkserver")
    s = Server(directory)
    yield s
    s.close()


def _forked_pid(err: str) -> int:
    (pid,) = re.findall(r"forked by the node's fork server \(pid (\d+)\)", err)
    return int(pid)


def test_a_forked_worker_takes_the_launched_process_place(server, tmp_path):
    """Its exit code, stdout and working directory are the launched process's; its pid is its own."""
    out_file = tmp_path / "stdout.txt"
    with out_file.open("w") as out:
        proxy = server.launch("exit", "7", stdout=out)
        _, err = proxy.communicate(timeout=60)
    assert proxy.returncode == 7, err
    pid = _forked_pid(err)
    assert pid != proxy.pid and f"launched as pid {proxy.pid}" in err, err
    assert out_file.read_text().startswith(f"target pid {pid} cwd {REPO} rank 0"), "stdout follows the proxy's"
    _wait(lambda: not _alive(pid), "the server's reaping of its child")


def test_a_forked_worker_inherits_no_thread_and_no_cuda_state(server, tmp_path):
    """What the worker finds at its start: one thread, CUDA not initialised, no device file; torch was imported by
    the server; the environment, argv and working directory are the launched process's; the pid NVRx's rank-monitor
    client reports (the one its monitor signals) is the worker's own."""
    report = tmp_path / "probe.json"
    proxy = server.launch("probe", str(report), env={"PROBE_MARKER": "launched", "RANK": "3"})
    _, err = proxy.communicate(timeout=60)
    assert proxy.returncode == 0, err
    probe = json.loads(report.read_text())
    assert probe["pid"] == _forked_pid(err) != proxy.pid
    assert probe["threads"] == 1 and probe["python_threads"] == 1, probe
    assert probe["cuda_initialized"] is False and probe["nvidia_files"] == [], probe
    assert probe["torch_imported_before"], "the worker's torch is the server's"
    assert probe["rank_monitor_pid"] == probe["pid"], "NVRx's rank monitor is told the worker's pid"
    assert probe["env_marker"] == "launched" and probe["cwd"] == str(REPO) and probe["argv"][1:] == ["probe",
                                                                                                     str(report)]


def test_sigterm_reaches_the_forked_worker_and_its_sigkill_is_the_proxys(server, tmp_path):
    """The proxy's SIGTERM (ft_launcher stopping the group) reaches the forked worker; a SIGKILL of the worker (as
    NVRx's rank monitor sends it) is a signal death of the process ft_launcher watches."""
    proxy = server.launch("sleep", str(tmp_path))
    _wait(lambda: (tmp_path / "pid").exists(), "the worker's start")
    worker = int((tmp_path / "pid").read_text())
    assert worker != proxy.pid
    proxy.send_signal(signal.SIGTERM)
    _, err = proxy.communicate(timeout=30)
    assert proxy.returncode == 143 and (tmp_path / "sigterm").read_text() == str(worker), err

    (tmp_path / "pid").unlink()
    proxy = server.launch("sleep", str(tmp_path))
    _wait(lambda: (tmp_path / "pid").exists(), "the second worker's start")
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    proxy.communicate(timeout=30)
    assert proxy.returncode == -signal.SIGKILL, "ft_launcher must see a signal death"


@pytest.mark.multiprocess
@pytest.mark.serial
def test_a_sigkilled_worker_is_reported_before_the_kernel_has_released_its_memory(tmp_path):
    """A worker killed with much memory takes the kernel a while to release it (seconds for a GPU worker's device
    memory and page-locked slots); its proxy reports the signal death as the exit begins, so ft_launcher restarts
    the rank meanwhile. Here 2 GiB of host memory: the proxy is gone while the worker is still being torn down (its
    ``/proc`` entry not yet a zombie). Serial: the proxy's poll must not wait for a busy core."""
    (tmp_path / "server").mkdir()
    server = Server(tmp_path / "server")
    try:
        proxy = server.launch("hold", str(tmp_path), env={"HOLD_MIB": "2048"})
        _wait(lambda: (tmp_path / "pid").exists(), "the worker's 2 GiB", timeout=120)
        worker = int((tmp_path / "pid").read_text())
        os.kill(worker, signal.SIGKILL)
        while proxy.poll() is None:
            assert not _torn_down(worker), "the proxy waited for the worker's teardown"
        torn_down_after = not _torn_down(worker)
        _, err = proxy.communicate(timeout=30)
        assert proxy.returncode == -signal.SIGKILL, err
        assert torn_down_after, "the worker's teardown ended before its proxy was reaped"
        assert f"worker pid {worker} is exiting without an exit code (a signal)" in err, err
    finally:
        server.close()


def _torn_down(pid: int) -> bool:
    """Whether process ``pid`` released its memory: a zombie, or reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X")


def test_a_differing_import_time_environment_is_refused(server):
    proxy = server.launch("--help-config", env={"CUDA_VISIBLE_DEVICES": "7"})
    out, err = proxy.communicate(timeout=120)
    assert proxy.returncode == 0 and "[train]" in out, err  # the trainer's own CLI, in the launched process
    assert "the node's fork server refused: CUDA_VISIBLE_DEVICES differs (taker: None, worker: '7'); starting " \
           "normally" in err, err
    assert server.proc.poll() is None, "still serving"


def test_a_dead_fork_server_degrades_to_ordinary_starts(tmp_path, caplog):
    """Killed, the server leaves its socket refusing: a launched worker says so in one line and runs itself; a
    checkpoint writer's queue falls back to NVRx's own spawn."""
    s = Server(tmp_path)
    s.proc.kill()
    s.close()
    proxy = s.launch("--help-config")
    out, err = proxy.communicate(timeout=120)
    assert proxy.returncode == 0 and "[train]" in out, err
    lines = [line for line in err.splitlines() if "fork server" in line]
    assert lines == [f"trainer: the node's fork server ({tmp_path / 'forkserver.sock'}) does not answer "
                     "(ConnectionRefusedError); starting normally"], err

    from trainer.checkpoint.writer import Writer

    os.environ["TRAINER_FORKSERVER_DIR"] = str(tmp_path)
    try:
        queue = Writer._new_queue()
    finally:
        del os.environ["TRAINER_FORKSERVER_DIR"]
    assert queue.persistent_caller is None, "NVRx makes (and spawns) its own caller at the first request"
    (record,) = [r for r in caplog.records if "fork server" in r.getMessage()]
    assert "starts the ordinary way" in record.getMessage()


UNFIT = """
import threading, torch
from trainer.startup import forkserver
print(forkserver.unfit())
torch.cuda.is_initialized = lambda: True
print(forkserver.unfit())
stop = threading.Event()
threading.Thread(target=stop.wait).start()
print(forkserver.unfit())
stop.set()
"""


def test_a_server_that_would_fork_a_thread_or_a_device_refuses():
    """``unfit`` (checked after the server's imports) names a second thread and an initialised CUDA."""
    result = subprocess.run([sys.executable, "-c", UNFIT], env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    expected = ["None", "CUDA was initialised by its imports", "2 threads after its imports"]
    assert result.stdout.splitlines() == expected, result.stderr


def _forked(server: Server, target, *args) -> forkserver.Process:
    os.environ.update({"TRAINER_FORKSERVER_DIR": str(server.directory), "PROBE_MARKER": "requester"})
    try:
        process = forkserver.Process(target=target, args=args)
        process.start()
    finally:
        for name in ("TRAINER_FORKSERVER_DIR", "PROBE_MARKER"):
            del os.environ[name]
    return process


def test_a_forked_process_is_the_requesters_child_in_all_but_its_parent(server, tmp_path):
    """As a checkpoint writer is started: its exit code comes back through the sentinel (the server reaps it), and
    it has its requester's environment and working directory; its parent is the server, its owner the requester."""
    import standby_target

    for code in (0, 3):
        process = _forked(server, standby_target.process_report, str(tmp_path / f"{code}.json"), code)
        process.join(timeout=60)
        assert process.exitcode == code
        report = json.loads((tmp_path / f"{code}.json").read_text())
        assert report["pid"] == process.pid and report["ppid"] == server.proc.pid, report
        assert report["owner"] == os.getpid() and report["env_marker"] == "requester", report
        assert report["cwd"] == os.getcwd()


def test_a_forked_writer_exits_when_its_owner_dies(server, tmp_path):
    """The checkpoint writer's watchdog: a forked writer's parent is the server, so it watches its owner's pipe."""
    pid_file = tmp_path / "pid"
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, standby_target; from trainer.startup import forkserver; "
         f"forkserver.Process(target=standby_target.orphan_watch, args=({str(pid_file)!r},)).start(); "
         "time.sleep(600)"],
        env={**server.env(), "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO / "trainer_image")])}, cwd=REPO)
    try:
        _wait(lambda: pid_file.exists() and pid_file.read_text(), "the forked writer's start")
        writer = int(pid_file.read_text())
        assert _alive(writer) and writer != owner.pid
        owner.kill()
        owner.wait()
        _wait(lambda: not _alive(writer), "the orphaned writer's exit")
    finally:
        if owner.poll() is None:
            owner.kill()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_standby_server_forks_its_standbys_which_die_with_it(server, tmp_path):
    """With a fork server, a warm standby is its child (no imports of its own); it takes a launched worker over as
    a spawned one does, and a standby not yet taken dies with the standby server that asked for it."""
    directory = tmp_path / "standby"
    directory.mkdir()
    log = tmp_path / "standby-server.log"
    with log.open("w") as err:
        standbys = subprocess.Popen([sys.executable, "-m", "trainer.startup.standby", "serve", "--nproc", "1", "--dir",
                                     str(directory), "--target", TARGET], stderr=err, cwd=REPO,
                                    env={**server.env(), "TRAINER_STANDBY_DIR": str(directory)},
                                    start_new_session=True)
    warm = lambda: [int(p) for p in re.findall(r"warm in [\d.]+ s \(pid (\d+)\)", log.read_text())]  # noqa: E731
    try:
        (directory / "first-step-0").touch()
        _wait(lambda: len(warm()) == 1, "the standby's warm-up")
        assert _parent(warm()[0]) == server.proc.pid, log.read_text()
        proxy = launch(directory, "exit", "3")
        _, err = proxy.communicate(timeout=60)
        assert proxy.returncode == 3 and f"standby worker (pid {warm()[0]}, warm for" in err, err
        (directory / "first-step-0").touch()
        _wait(lambda: len(warm()) == 2, "the replacement's warm-up")
        replacement = warm()[1]
        assert _parent(replacement) == server.proc.pid
        os.kill(standbys.pid, signal.SIGKILL)
        standbys.wait()
        _wait(lambda: not _alive(replacement), "the standby's death with its server")
    finally:
        if standbys.poll() is None:
            standbys.kill()
            standbys.wait()
    assert "spawning one" not in log.read_text()


def test_a_worker_launched_while_the_server_imports_waits_for_it(tmp_path):
    """The first workers of a job are launched while the server still imports: they wait for its socket while its
    process lives (``TRAINER_FORKSERVER_PID``), then are forked; once that process is gone, they start themselves."""
    placeholder = subprocess.Popen(["sleep", "600"])  # stands for the server's process until its socket is there
    env = {**_env(tmp_path), "TRAINER_FORKSERVER_DIR": str(tmp_path), "TRAINER_FORKSERVER_PID": str(placeholder.pid)}
    env.pop("TRAINER_STANDBY_DIR")
    proxy = subprocess.Popen([sys.executable, "-m", "trainer", "exit", "5"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    s = None
    try:
        s = Server(tmp_path)
        _, err = proxy.communicate(timeout=60)
        assert proxy.returncode == 5 and "forked by the node's fork server" in err, err
    finally:
        placeholder.kill()
        placeholder.wait()
        if s is not None:
            s.close()
    proxy = subprocess.Popen([sys.executable, "-m", "trainer", "--help-config"], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proxy.communicate(timeout=120)
    assert proxy.returncode == 0 and "[train]" in out, err
    assert "fork server" in err and "starting normally" in err, err


@pytest.mark.parametrize("value", ["yes", "2"])
def test_entrypoint_rejects_a_bad_trainer_forkserver(value):
    result = subprocess.run([str(REPO / "trainer_image" / "entrypoint.sh"), "--config", "tiny"], capture_output=True,
                            text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "TRAINER_FORKSERVER": value})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"entrypoint: TRAINER_FORKSERVER must be True or False (1 or 0); got '{value}'"
