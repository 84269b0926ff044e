"""The notebook runs top to bottom against the local runner (the cluster cell is skipped without KFP_HOST)."""

import json
from pathlib import Path
from types import SimpleNamespace

import kfp
import kfp.client
import nbformat
import pytest
from nbclient import NotebookClient

from pipelines import cli
from testlib import MICRO_MODEL

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "run_pipeline.ipynb"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_notebook_runs_locally(tmp_path, monkeypatch):
    monkeypatch.delenv("KFP_HOST", raising=False)
    monkeypatch.delenv(cli.IN_CLUSTER_ENV, raising=False)
    monkeypatch.setenv("NOTEBOOK_RUN_ROOT", str(tmp_path))
    monkeypatch.setenv("NOTEBOOK_STEPS", "20")  # past the sigkill at step 17; 10 steps fewer than the default
    # Small batches (2 x 64 tokens per rank) of the micro model, a short evaluation and the demo's two ranks on one node (one launcher
    # fewer to start): that the notebook runs through is checked here; what the run's numbers mean, and the nodes,
    # are test_local_pipeline's.
    monkeypatch.setenv("NOTEBOOK_PARAMS", json.dumps({"batch_size": 2, "seq_len": 64, "eval_batch_size": 2,
                                                      "eval_max_batches": 4, "nodes": 1, "procs_per_node": 2,
                                                      "trainer_overrides": list(MICRO_MODEL)}))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=800, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "compiled" in outputs and "val loss" in outputs and "HTML report:" in outputs
    assert "KFP_HOST is not set" in outputs
    assert (tmp_path / "pipeline.yaml").exists()


class RecordingClient:
    calls: list = []

    def __init__(self, **kwargs):
        self.calls.append(("init", kwargs))
        self._healthz_api = SimpleNamespace(  # the CLI's one probe: a multi-user KFP
            healthz_service_get_healthz=lambda: SimpleNamespace(multi_user=True))

    def create_experiment(self, name, namespace=None):
        return SimpleNamespace(experiment_id="exp-1")

    def create_run_from_pipeline_package(self, pipeline_file, **kwargs):
        self.calls.append(("run", kwargs))
        return SimpleNamespace(run_id="run-1")


def run_cluster_cells(monkeypatch, tmp_path, env: dict[str, str | None], pod_namespace: str = "") -> list:
    """The notebook's set-up cell and its cluster cell, against a recording kfp.Client (`pod_namespace`: the
    ServiceAccount namespace file of the pod the notebook runs in; env None: unset)."""
    RecordingClient.calls = []
    monkeypatch.setattr(kfp, "Client", RecordingClient)
    monkeypatch.setattr(cli, "KFP_CONTEXT_FILE", str(tmp_path / "no-kfp-context.json"))
    (tmp_path / "sa-namespace").write_text(pod_namespace)
    monkeypatch.setattr(cli, "SA_NAMESPACE_FILE", tmp_path / "sa-namespace")
    for name in ("KFP_HOST", cli.TOKEN_ENV, cli.COOKIES_ENV, cli.IN_CLUSTER_ENV, "KFP_NAMESPACE", "BACKEND",
                 "IMAGE_PULL_SECRETS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NOTEBOOK_RUN_ROOT", str(tmp_path))
    monkeypatch.setenv("IMAGE", "registry.example.com/team/resilient-train:0.1.0")
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    for name in [n for n, v in env.items() if v is None]:
        monkeypatch.delenv(name)
    code = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    scope: dict = {}
    exec(code[0], scope)  # noqa: S102 - the notebook's own cells
    exec(code[-1], scope)  # noqa: S102
    return RecordingClient.calls


def test_notebook_submits_from_a_laptop_with_a_token(monkeypatch, tmp_path):
    calls = run_cluster_cells(monkeypatch, tmp_path, {"KFP_HOST": "https://kf.example.com/pipeline",
                                                      cli.TOKEN_ENV: "tok", "KFP_NAMESPACE": "team-a"})
    assert calls[0] == ("init", {"host": "https://kf.example.com/pipeline", "existing_token": "tok",
                                 "namespace": "team-a"})
    run = calls[1][1]
    assert run["service_account"] == "default-editor" and run["arguments"]["model"] == "1b"


def test_notebook_in_a_kubeflow_pod_uses_its_pipelines_token(monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("sa-token")
    calls = run_cluster_cells(monkeypatch, tmp_path, {cli.IN_CLUSTER_ENV: "10.0.0.1",
                                                      kfp.client.KF_PIPELINES_SA_TOKEN_ENV: str(token)},
                              pod_namespace="team-notebook")
    kwargs = calls[0][1]
    assert kwargs["host"] == cli.IN_CLUSTER_HOST.format(namespace="kubeflow")
    assert isinstance(kwargs["credentials"], kfp.client.ServiceAccountTokenVolumeCredentials)
    assert kwargs["namespace"] == "team-notebook"  # the notebook pod's own: no KFP_NAMESPACE needed


def test_notebook_without_an_image_says_what_to_set(monkeypatch, tmp_path, capsys):
    calls = run_cluster_cells(monkeypatch, tmp_path, {"KFP_HOST": "https://kf.example.com/pipeline",
                                                      cli.TOKEN_ENV: "tok", "KFP_NAMESPACE": "team-a", "IMAGE": None})
    assert calls == []
    out = capsys.readouterr().out
    assert "IMAGE is not set" in out and "REGISTRY/resilient-train:TAG" in out


def test_notebook_submits_with_the_chosen_backend_and_pull_secrets(monkeypatch, tmp_path):
    calls = run_cluster_cells(monkeypatch, tmp_path, {
        "KFP_HOST": "https://kf.example.com/pipeline", cli.TOKEN_ENV: "tok", "KFP_NAMESPACE": "team-a",
        "BACKEND": "trainjob", "IMAGE_PULL_SECRETS": "regcred,mirror"})
    (run,) = [c[1] for c in calls if c[0] == "run"]
    assert run["arguments"]["backend"] == "trainjob"
    defaults = cli.package_defaults(str(tmp_path / "cluster-pipeline.yaml"))
    assert defaults["image_pull_secrets"] == ["regcred", "mirror"]  # the training pods
    assert defaults["step_image_pull_secret"] == "regcred"  # the steps
