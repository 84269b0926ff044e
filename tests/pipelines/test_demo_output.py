"""``make demo`` shows progress, recovery events and outcomes; everything else goes to the log file."""

import subprocess
import sys

from pipelines.demo import filtered_output, shown

KFP_NOISE = [
    "05:14:01.037 - INFO - Executing task \x1b[96m'train'\x1b[0m",
    "    [KFP Executor 2026-12-01 05:14:10,097 INFO]: Got executor_input:",
    "    {", '        "inputs": {', '            "parameterValues": {"steps": 60}', "    }",
    "/x/kfp/local/subprocess_task_handler.py:81: RuntimeWarning: You may be attemping to run a task ...",
    "    Traceback (most recent call last):",
]
SHOWN_LINES = [
    "    [train] step 33/60 loss 6.0200 (55%) 1,819 tok/s",
    "    2026-12-01 05:15:05,567 WARNING [rank0] trainer.faults: injecting fault exception at step 15 (pid 1)",
    "05:15:40.348 - INFO - Task \x1b[96m'train'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m",
    "    [eval] step 60: val loss 6.2763, perplexity 531.80; promoted",
    "    components.lib.local_launcher.RestartBudgetExceeded: training exited 202 (PREEMPTED) (retryable) and ...",
]


def test_only_progress_recovery_and_outcomes_are_shown():
    assert [shown(line) for line in KFP_NOISE] == [None] * len(KFP_NOISE)
    assert shown(SHOWN_LINES[0]) == "[train] step 33/60 loss 6.0200 (55%) 1,819 tok/s"
    assert shown(SHOWN_LINES[2]) == "05:15:40.348 - INFO - Task 'train' finished with status FAILURE"
    assert all(shown(line) for line in SHOWN_LINES)


def test_the_terminal_gets_the_shown_lines_and_the_log_file_everything(tmp_path, capfd):
    log = tmp_path / "logs" / "demo.log"
    with filtered_output(log):
        print("\n".join(KFP_NOISE[:3]), flush=True)
        print(SHOWN_LINES[0], file=sys.stderr, flush=True)
        # a child process (kfp.local's step subprocesses) writes to the same stdout
        subprocess.run([sys.executable, "-c", f"print({KFP_NOISE[3]!r}); print({SHOWN_LINES[1]!r})"], check=True)
        print(SHOWN_LINES[1], flush=True)  # a failed step's error repeats the log tail: shown once
    out, err = capfd.readouterr()
    assert out.splitlines() == [shown(SHOWN_LINES[0]), shown(SHOWN_LINES[1])] and err == ""
    logged = log.read_text()
    for line in [*KFP_NOISE[:4], *SHOWN_LINES[:2]]:
        assert line in logged
    print("after")  # the terminal is restored
    assert capfd.readouterr().out == "after\n"


def test_verbose_shows_everything(tmp_path, capfd):
    with filtered_output(tmp_path / "demo.log", verbose=True):
        print(KFP_NOISE[1], flush=True)
    assert capfd.readouterr().out == KFP_NOISE[1] + "\n"
