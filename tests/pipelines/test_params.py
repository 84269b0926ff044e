"""Parameter validation: every problem reported at once, each saying what to change."""

import pytest

from components.lib.params import DEFAULTS, ParamError, PipelineParams, parse_faults
from pipelines.demo import demo_params


def errors(**kw) -> str:
    return "\n".join(PipelineParams(**kw).errors())


def test_defaults_and_demo_are_valid(tmp_path):
    DEFAULTS.validate()
    params = demo_params(tmp_path / "work")
    assert {f.kind for f in parse_faults(params["faults"])} == {"exception", "sigkill", "sigterm"}


def test_steps_must_exceed_checkpoint_interval():
    msg = errors(steps=40, checkpoint_interval=50)
    assert "steps (40) must be greater than checkpoint_interval (50)" in msg
    assert "lower checkpoint_interval or raise steps" in msg


@pytest.mark.parametrize("kw, expected", [
    ({"backend": "local", "nodes": 2, "workdir": "/tmp/w"}, "nodes must be 1 with backend 'local'"),
    ({"workdir": "/data/runs"}, "must be under /mnt/shared"),
    ({"workdir": "runs/x", "backend": "local"}, "workdir must be an absolute path"),
    ({"faults": "0:10:explode"}, "fault '0:10:explode' must look like rank:step:kind"),
    ({"faults": "0:999:sigkill"}, "fault 0:999:sigkill: step must be in 1..steps (400)"),
    ({"faults": "2:10:sigkill"}, "rank must be < the world size (2"),
    ({"faults": "0:10:exception", "inprocess_restart": False}, "set inprocess_restart=True"),
    ({"model": "13b"}, "model must be one of ['tiny', '1b', '8b']"),
    ({"backend": "slurm"}, "backend must be one of"),
    ({"vocab_size": 100}, "vocab_size must be 257.."),
    ({"trainer_overrides": ["--train.run_dir=/x"]}, "sets a key the pipeline controls"),
    ({"trainer_overrides": ["lr=1"]}, "must look like '--section.key=value'"),
    ({"tolerations": [{"key": "a", "effects": "NoSchedule"}]}, "unknown key(s) ['effects']"),
    ({"init_from": "relative/dir"}, "init_from must be"),
    ({"steps": True}, "steps must be an integer"),
])
def test_bad_parameter_names_the_fix(kw, expected):
    assert expected in errors(**kw)


def test_all_errors_are_reported_together():
    with pytest.raises(ParamError) as info:
        PipelineParams(steps=0, nodes=0, backend="nope").validate()
    assert len(info.value.errors) >= 3
    assert "steps must be 1..10000000; got 0" in str(info.value)


def test_unknown_parameter_lists_the_known_ones():
    with pytest.raises(ParamError, match="unknown parameter.*'stpes'.*'steps'"):
        PipelineParams.from_mapping({"stpes": 10})
