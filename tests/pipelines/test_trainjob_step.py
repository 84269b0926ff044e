"""backend=trainjob in the train step and the compiled pipeline: parameters, the TrainJob it submits, cleanup
through the exit handler, and the launcher it picks."""

import pytest

from components.lib import k8s_launcher, trainjob
from components.lib.layout import RunLayout
from components.lib.params import ParamError, PipelineParams
from components.lib.pytorchjob import job_name
from components.lib.train_step import TrainJobBackend, backend_for, trainer_args


IMAGE = "registry.example.com/resilient-train:1"

def test_trainjob_params_need_the_shared_volume():
    PipelineParams(backend="trainjob", image=IMAGE).validate()
    with pytest.raises(ParamError) as err:
        PipelineParams(backend="trainjob", image=IMAGE, workdir="/tmp/w", pvc_name="").validate()
    text = str(err.value)
    assert "must be under /mnt/shared" in text and "with backend 'trainjob'" in text and "pvc_name must name" in text


def test_trainjob_backend_submits_a_trainjob_with_the_runs_args(monkeypatch):
    monkeypatch.setenv("KUEUE_QUEUE_NAME", "train-queue")
    p = PipelineParams(backend="trainjob", image=IMAGE, nodes=2, gpus_per_node=8, namespace="team-a",
                       node_selector={"pool": "h100"})
    layout = RunLayout(p.workdir, "3f2a9c1e-uuid")
    backend = backend_for("trainjob")
    assert isinstance(backend, TrainJobBackend)
    spec = backend.spec(p, layout, trainer_args(p, layout, "/mnt/shared/x/data"))
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec))
    assert trainjob.webhook_errors(manifest) == []
    assert manifest["metadata"]["name"] == job_name("3f2a9c1e-uuid", "train")
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "train-queue"
    assert (manifest["spec"]["trainer"]["numNodes"], manifest["spec"]["trainer"]["numProcPerNode"]) == (2, 8)
    assert "--train.device=cuda" in manifest["spec"]["trainer"]["args"]


def test_trainjob_cleanup_deletes_by_the_deterministic_name():
    deleted = []

    class Fake:
        def delete(self, name, namespace):
            deleted.append((name, namespace))
            return True

    p = PipelineParams(backend="trainjob", image=IMAGE, namespace="ns")
    message = TrainJobBackend(launcher_factory=Fake).cleanup(p, RunLayout(p.workdir, "run-9"))
    assert message == f"deleted TrainJob ns/{job_name('run-9', 'train')}"


def test_trainjob_backend_uses_the_trainjob_launcher(monkeypatch):
    picked = []
    monkeypatch.setattr(k8s_launcher.TrainJobLauncher, "from_environment", classmethod(lambda cls: picked.append(cls)))
    TrainJobBackend()._launcher()
    assert picked == [k8s_launcher.TrainJobLauncher]


def test_compiled_pipeline_runs_trainjob_through_its_backend_parameter(tmp_path):
    import yaml

    from pipelines.compile import compile_pipeline

    spec, _ = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", image=IMAGE).read_text())
    backend = spec["root"]["inputDefinitions"]["parameters"]["backend"]
    assert backend["defaultValue"] == "pytorchjob"
    assert "trainjob (Kubeflow Trainer v2)" in backend["description"]
    tasks = dict(spec["root"]["dag"]["tasks"])
    for comp in spec["components"].values():
        tasks.update((comp.get("dag") or {}).get("tasks", {}))
    for step in ("validate-params", "train", "cleanup"):  # the same value reaches validation, training, cleanup
        assert tasks[step]["inputs"]["parameters"]["backend"]["componentInputParameter"] in (
            "backend", "pipelinechannel--backend"), step
    PipelineParams.from_mapping({"backend": "trainjob", "image": IMAGE}).validate()  # a run with backend=trainjob passes step 1
