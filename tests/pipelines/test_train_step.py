"""The train step's interface: trainer args, both backends (PyTorchJob spec, local run with a fake entrypoint)."""

import io
import json

import pytest
from pipeline_fakes import write_run_files

from components.lib.layout import RunLayout
from components.lib.params import PipelineParams
from components.lib.pytorchjob import build_pytorchjob, job_name, pod_tolerations, to_manifest, webhook_errors
from components.lib.train_step import (
    LocalBackend, PyTorchJobBackend, TrainStepError, collect_outcome, resolve_init_from, run_train, step_attempts,
    trainer_args,
)


def local_params(tmp_path, **kw):
    return PipelineParams(backend="local", workdir=str(tmp_path / "w"), steps=12, checkpoint_interval=4,
                          max_cluster_restarts=0, **kw)


def test_trainer_args_put_everything_under_the_run(tmp_path):
    p = local_params(tmp_path, faults="0:5:exception", seq_len=64, trainer_overrides=["--optim.lr=1e-3"])
    layout = RunLayout(p.workdir, "run-1")
    args = trainer_args(p, layout, "/data", "/warm")
    assert args[:2] == ["--config", "tiny"]
    assert f"--train.run_dir={tmp_path}/w/run-1/train" in args
    assert f"--checkpoint.dir={tmp_path}/w/run-1/checkpoints" in args
    assert {"--resiliency.faults=0:5:exception", "--data.seq_len=64", "--checkpoint.init_from=/warm",
            "--train.device=cpu", "--resiliency.inprocess=true", "--data.path=/data"} <= set(args)
    assert args[-1] == "--optim.lr=1e-3"


def test_run_ids_cannot_escape_the_workdir():
    with pytest.raises(ValueError, match="names a directory"):
        RunLayout("/w", "../etc")


def test_local_run_reports_checkpoint_and_metrics(tmp_path, fake_trainer_entrypoint):
    p = local_params(tmp_path)
    out = io.StringIO()
    outcome = run_train(p, "run-1", "/data", backend=LocalBackend(fake_trainer_entrypoint), out=out)
    assert outcome.step == 12 and outcome.model == "tiny"
    assert outcome.checkpoint_dir == f"{tmp_path}/w/run-1/checkpoints"
    m = outcome.metrics
    assert m["restarts_injob"] == 1 and m["restarts_inprocess"] == 0 and m["goodput"] == 0.8
    assert m["steps"] == 12 and m["step_attempts"] == 1 and m["final_loss"] == pytest.approx(7.4)
    assert "[train] step 12/12 loss 7.4000 (100%)" in out.getvalue()
    # a second attempt (pipeline retry) of the same run is counted and resumes in the same directories
    run_train(p, "run-1", "/data", backend=LocalBackend(fake_trainer_entrypoint), out=out)
    assert step_attempts(RunLayout(p.workdir, "run-1")) == 2
    assert "resuming from" in out.getvalue()


def test_success_without_summary_is_an_error(tmp_path):
    p = local_params(tmp_path)
    with pytest.raises(TrainStepError, match="summary.json is missing"):
        collect_outcome(p, RunLayout(p.workdir, "r"))


def test_stopping_short_of_the_steps_is_an_error(tmp_path):
    p = local_params(tmp_path)
    write_run_files(RunLayout(p.workdir, "r").run_dir, steps=8)
    with pytest.raises(TrainStepError, match="stopped at step 8 of 12"):
        collect_outcome(p, RunLayout(p.workdir, "r"))


def test_local_cleanup_is_idempotent(tmp_path):
    p = local_params(tmp_path)
    backend = LocalBackend()
    assert backend.cleanup(p, RunLayout(p.workdir, "r")) == "no local training processes left"
    assert backend.cleanup(p, RunLayout(p.workdir, "r")) == "no local training processes left"


def test_pytorchjob_spec_mounts_the_pvc_and_queues(monkeypatch):
    monkeypatch.setenv("KUEUE_QUEUE_NAME", "train-queue")
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    p = PipelineParams(nodes=2, gpus_per_node=8, namespace="team-a", node_selector={"pool": "h100"},
                       tolerations=[gpu_taint], image="registry.example.com/rt:1", image_pull_secrets=["regcred"],
                       launcher_node_selector={"pool": "cpu"})
    layout = RunLayout(p.workdir, "3f2a9c1e-uuid")
    spec = PyTorchJobBackend().spec(p, layout, trainer_args(p, layout, "/mnt/shared/x/data"))
    assert spec.name == job_name("3f2a9c1e-uuid", "train") and spec.namespace == "team-a"
    assert (spec.nodes, spec.nproc_per_node, spec.gpus_per_node) == (2, 8, 8)
    manifest = to_manifest(build_pytorchjob(spec))
    assert webhook_errors(manifest) == []
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "train-queue"
    # The GPU placement goes to every training pod (not to the launcher step: tests/pipelines/test_compile.py).
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["nodeSelector"] == {"pool": "h100"}
        assert replica["template"]["spec"]["tolerations"] == pod_tolerations([gpu_taint])  # + a lost node's, bounded
        assert replica["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert replica["template"]["spec"]["containers"][0]["image"] == "registry.example.com/rt:1"
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "train-shared"}} in pod["spec"]["volumes"]
    assert "--train.device=cuda" in pod["spec"]["containers"][0]["args"]


class FakeK8sLauncher:
    def __init__(self):
        self.deleted = []

    def delete(self, name, namespace):
        self.deleted.append((name, namespace))
        return len(self.deleted) == 1


def test_pytorchjob_cleanup_deletes_by_the_deterministic_name():
    fake = FakeK8sLauncher()
    backend = PyTorchJobBackend(launcher_factory=lambda: fake)
    p = PipelineParams(namespace="ns")
    layout = RunLayout(p.workdir, "run-9")
    assert backend.cleanup(p, layout).startswith("deleted PyTorchJob ns/")
    assert backend.cleanup(p, layout).endswith("was already gone")
    assert fake.deleted == [(job_name("run-9", "train"), "ns")] * 2


def test_init_from_promoted_reads_the_registry(tmp_path):
    p = local_params(tmp_path, init_from="promoted")
    out = io.StringIO()
    assert resolve_init_from(p, out) == "" and "nothing promoted yet" in out.getvalue()
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "promoted-tiny.json").write_text(json.dumps({"checkpoint_dir": "/ckpt", "step": 3}))
    assert resolve_init_from(p, out) == "/ckpt"


class ExitingBackend:
    """A backend whose job fails with the trainer's `code` (as JobFailedError / LocalLaunchError carry it)."""

    name = "fake"

    def __init__(self, code):
        self.code, self.runs = code, 0

    def base_model_path(self, p):
        return p.base_model

    def run(self, p, layout, args, out):
        from components.lib.local_launcher import PermanentFailure, RestartBudgetExceeded

        self.runs += 1
        error = PermanentFailure if self.code < 128 else RestartBudgetExceeded
        raise error(f"training failed with exit {self.code}", exit_code=self.code)

    def cleanup(self, p, layout):
        return ""


@pytest.mark.parametrize("code", [1, 2, 3, 4])
def test_a_retry_after_a_permanent_exit_launches_nothing(tmp_path, code):
    """KFP's set_retry retries every failure; a data error (exit 3) must not relaunch the GPU job 3 more times."""
    from components.lib.train_step import PermanentFailureError

    p, backend = local_params(tmp_path), ExitingBackend(code)
    with pytest.raises(RuntimeError, match=f"exit {code}"):
        run_train(p, "run-1", "/data", backend=backend, out=io.StringIO())
    for retry in (2, 3):  # each retry ends at once, and says why in one line
        with pytest.raises(PermanentFailureError) as err:
            run_train(p, "run-1", "/data", backend=backend, out=io.StringIO())
        assert err.value.exit_code == code and len(str(err.value).splitlines()) == 1
        assert "attempt 1 of run run-1 ended with exit" in str(err.value) and "start a new run" in str(err.value)
        assert step_attempts(RunLayout(p.workdir, "run-1")) == retry
    assert backend.runs == 1


@pytest.mark.parametrize("code", [137, 200, 201, 202, 204])
def test_a_retry_after_a_retryable_exit_relaunches(tmp_path, code):
    p, backend = local_params(tmp_path), ExitingBackend(code)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=f"exit {code}"):
            run_train(p, "run-1", "/data", backend=backend, out=io.StringIO())
    assert backend.runs == 2


def test_the_train_component_ends_a_doomed_retry_with_one_line_and_the_code(tmp_path, capsys):
    from kfp import dsl

    from components.train import train

    p = local_params(tmp_path)
    with pytest.raises(RuntimeError):
        run_train(p, "run-1", "/data", backend=ExitingBackend(3), out=io.StringIO())
    dataset = dsl.Dataset(uri=str(tmp_path / "a" / "dataset"), metadata={"data_dir": "/data"})
    outputs = dict(checkpoint=dsl.Model(uri=str(tmp_path / "a" / "ckpt")), metrics=dsl.Metrics(uri=str(tmp_path / "m")))
    with pytest.raises(SystemExit) as done:
        train.python_func(**p.__dict__, run_id="run-1", dataset=dataset, **outputs)
    assert done.value.code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not relaunching" in err[0] and "3 (DATA_ERROR)" in err[0]


def test_pytorchjob_passes_a_base_model_uri_to_the_trainer_with_the_credentials():
    p = PipelineParams(image="registry.example.com/rt:1", base_model="hf://meta-llama/Llama-3.2-1B",
                       corpus_secret="team-creds")
    layout = RunLayout(p.workdir, "run-1")
    backend = PyTorchJobBackend()
    spec = backend.spec(p, layout, trainer_args(p, layout, "/mnt/shared/d", base_model=backend.base_model_path(p)))
    assert "--model.from_hf=hf://meta-llama/Llama-3.2-1B" in spec.args  # the trainer's local rank 0 downloads it
    assert spec.credentials_secret == "team-creds" and spec.model_initializer is None
    on_volume = PipelineParams(image="registry.example.com/rt:1", base_model="/mnt/shared/models/llama")
    spec = backend.spec(on_volume, layout, trainer_args(on_volume, layout, "/mnt/shared/d"))
    assert "--model.from_hf=/mnt/shared/models/llama" in spec.args and spec.credentials_secret is None
    assert not any(a.startswith("--model.from_hf") for a in trainer_args(PipelineParams(), layout, "/d"))
