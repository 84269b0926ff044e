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
    # a lost node's pod leaves it in a minute and is replaced alone (tests/deploy/test_node_replacement.py)
    (patch,) = manifest["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    lost = {t["key"]: t["tolerationSeconds"] for t in node["template"]["spec"]["template"]["spec"]["tolerations"]}
    assert lost == {"node.kubernetes.io/not-ready": 60, "node.kubernetes.io/unreachable": 60}


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


def test_a_base_model_uri_is_downloaded_by_the_initializer_into_the_runs_workspace(tmp_path, monkeypatch):
    import io

    p = PipelineParams(backend="trainjob", image=IMAGE, base_model="hf://meta-llama/Llama-3.2-1B",
                       corpus_secret="team-creds")
    layout = RunLayout(p.workdir, "run-7")
    backend = TrainJobBackend()
    args = trainer_args(p, layout, "/mnt/shared/x/data", base_model=backend.base_model_path(p))
    assert "--model.from_hf=/workspace/model" in args  # where the initializer put it, not the URI
    spec = backend.spec(p, layout, args)
    assert spec.model_initializer.storage_uri == "hf://meta-llama/Llama-3.2-1B"
    assert spec.model_initializer.workspace_subpath == "resilient-train/run-7/workspace"  # = layout.workspace_dir
    assert spec.credentials_secret == "team-creds"
    manifest = trainjob.to_manifest(trainjob.build_trainjob(spec))
    assert trainjob.webhook_errors(manifest) == [] and manifest["spec"]["runtimeRef"]["name"] == \
        trainjob.MODEL_RUNTIME_NAME

    # run() makes the run's workspace (as the image's user) before the job starts
    submitted = []

    class Launcher:
        def run(self, spec):
            submitted.append(spec)
            from types import SimpleNamespace
            return SimpleNamespace(restarts=0, name=spec.name, namespace=spec.namespace, duration_s=1.0)

    from components.lib import train_step

    monkeypatch.setattr(train_step, "SHARED_MOUNT", str(tmp_path))  # the volume, here
    local = PipelineParams(backend="trainjob", image=IMAGE, base_model="s3://models/llama", workdir=str(tmp_path / "w"))
    out = io.StringIO()
    TrainJobBackend(launcher_factory=Launcher).run(local, RunLayout(local.workdir, "run-8"), args, out)
    assert (tmp_path / "w" / "run-8" / "workspace" / "model").is_dir()
    assert submitted[0].model_initializer.workspace_subpath == "w/run-8/workspace"
    assert "the model initializer downloads s3://models/llama" in out.getvalue()


def test_a_base_model_on_the_volume_is_passed_as_it_is():
    p = PipelineParams(backend="trainjob", image=IMAGE, base_model="/mnt/shared/models/llama-3.2-1b")
    layout = RunLayout(p.workdir, "run-9")
    backend = TrainJobBackend()
    spec = backend.spec(p, layout, trainer_args(p, layout, "/d", base_model=backend.base_model_path(p)))
    assert spec.model_initializer is None and spec.credentials_secret is None
    assert "--model.from_hf=/mnt/shared/models/llama-3.2-1b" in spec.args
    assert trainjob.to_manifest(trainjob.build_trainjob(spec))["spec"]["runtimeRef"]["name"] == trainjob.RUNTIME_NAME
