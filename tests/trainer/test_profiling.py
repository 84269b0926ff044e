"""``train.profile_steps``: a trace of exactly the window's steps, labelled per step; bad specs say what to write."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from trainer.config import ConfigError, parse_args
from trainer.profiling import StepProfiler


def test_the_trace_holds_the_window_steps_and_their_labels(tmp_path):
    profiler = StepProfiler("2-3", str(tmp_path), rank=1, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in range(1, 6):
        profiler.step(step)
        with profiler.label("checkpoint.save"):
            x = x @ x.T / 64
    profiler.close()
    trace = tmp_path / "profile" / "rank1-steps2-3.json.gz"
    events = json.load(gzip.open(trace, "rt"))["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"step 2", "step 3", "checkpoint.save"} <= names
    assert not {"step 1", "step 4", "step 5"} & names, "steps outside the window were profiled"
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [trace.name]
    cut = StepProfiler("2-9", str(tmp_path / "short"), rank=0, device=torch.device("cpu"))
    for step in range(1, 5):  # the loop ends inside the window: the name says which steps the trace holds
        cut.step(step)
    cut.close()
    assert [p.name for p in (tmp_path / "short" / "profile").iterdir()] == ["rank0-steps2-4.json.gz"]


def test_a_failed_attempt_leaves_no_trace_and_a_window_never_reached_none(tmp_path):
    profiler = StepProfiler("2-9", str(tmp_path), rank=0, device=torch.device("cpu"))
    profiler.step(1)
    profiler.step(2)
    profiler.discard()
    profiler.close()  # nothing left to write
    late = StepProfiler("50-60", str(tmp_path), rank=0, device=torch.device("cpu"))
    for step in range(1, 4):
        late.step(step)
    late.close()
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("spec, hint", [("abc", "FIRST-LAST, e.g. 30-32"), ("5-2", "1 <= FIRST <= LAST"),
                                        ("0-3", "1 <= FIRST <= LAST")])
def test_a_bad_window_names_the_key_and_the_form(spec, hint):
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", "tiny", "--data.path=runs/data", f"--train.profile_steps={spec}"])
    assert "train.profile_steps" in str(err.value) and hint in str(err.value)

