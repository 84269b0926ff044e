"""The test harness itself: a run that outlasts its timeout says where it hung."""

import os
import sys

import pytest
from testlib import run_session


def test_a_hung_run_fails_with_the_stacks_of_its_threads():
    code = ("import threading, time\n"
            "def stuck_in_a_thread(): time.sleep(60)\n"
            "threading.Thread(target=stuck_in_a_thread).start()\n"
            "print('started', flush=True)\n"
            "time.sleep(60)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        # 10 s: under make test's load the interpreter's own start took over 3 s once (it had not printed yet)
        run_session([sys.executable, "-c", code], dict(os.environ), timeout=10, timeout_message="hung")
    message = str(failed.value)
    assert message.startswith("hung") and "started" in message
    assert "stuck_in_a_thread" in message and "Current thread" in message, message
