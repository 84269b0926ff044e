"""The compiled pipeline: golden YAML, retry, caching, exit handler, Kubernetes config, room boundaries.

Regenerate the golden file on purpose with ``UPDATE_GOLDEN=1 pytest tests/pipelines/test_compile.py``.
"""

import ast
import subprocess
import sys
import difflib
import os
from pathlib import Path

import pytest
import yaml

from components.lib import credentials
from components.lib.params import DEFAULT_CORPUS_SECRET, PipelineParams
from components.lib.version import package_version
from pipelines.compile import compile_pipeline, main

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GOLDEN = HERE / "golden" / "training_pipeline.yaml"
VOLATILE = ("sdkVersion:",)
IMAGE = "registry.example.com/team/resilient-train:0.1.0"
PULL_SECRET = "regcred"
VERSION = "0.1.0+golden"


def normalized(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(VOLATILE))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[str, dict, dict]:
    path = compile_pipeline(tmp_path_factory.mktemp("c") / "pipeline.yaml", image=IMAGE,
                            image_pull_secrets=[PULL_SECRET], version=VERSION)
    text = path.read_text()
    spec, platform = list(yaml.safe_load_all(text))
    return text, spec, platform


def test_matches_golden(compiled):
    text = normalized(compiled[0])
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    expected = GOLDEN.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "compiled"))
        pytest.fail(f"compiled pipeline differs from {GOLDEN} (UPDATE_GOLDEN=1 to accept):\n{diff}")


def tasks(spec: dict) -> dict:
    out = dict(spec["root"]["dag"]["tasks"])
    for comp in spec["components"].values():
        out.update((comp.get("dag") or {}).get("tasks", {}))
    return out


def test_train_step_retries_with_a_long_window(compiled):
    retry = tasks(compiled[1])["train"]["retryPolicy"]
    assert retry == {"backoffDuration": "300s", "backoffFactor": 2.0, "backoffMaxDuration": "604800s",
                     "maxRetryCount": 3}


def test_local_variant_backs_off_in_seconds(tmp_path):
    spec, _ = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml", local=True).read_text())
    retry = tasks(spec)["train"]["retryPolicy"]
    assert retry["backoffDuration"] == "1s" and retry["backoffMaxDuration"] == "60s"


def test_caching_is_off_for_steps_with_side_effects(compiled):
    t = tasks(compiled[1])
    # validate-params too: it checks the image's version stamp, which a cached result would skip.
    for name in ("validate-params", "data-prep", "train", "evaluate-checkpoint", "export-model", "promote", "cleanup"):
        assert t[name]["cachingOptions"] == {}, name  # enableCache omitted = false


def test_exit_handler_cleans_up_after_the_whole_run(compiled):
    t = compiled[1]["root"]["dag"]["tasks"]
    assert t["cleanup"]["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}
    assert t["cleanup"]["dependentTasks"] == ["exit-handler-1"]
    assert "status" in t["cleanup"]["inputs"]["parameters"]
    inner = tasks(compiled[1])
    assert {"validate-params", "data-prep", "train", "evaluate-checkpoint", "condition-2"} <= set(inner)
    assert inner["condition-2"]["triggerPolicy"]["condition"] == \
        "inputs.parameter_values['pipelinechannel--evaluate-checkpoint-Output'] == true"
    # promote reads the gate's candidate and current_id from its decision artifact
    assert inner["promote"]["inputs"]["artifacts"]["decision"] == \
        {"componentInputArtifact": "pipelinechannel--evaluate-checkpoint-decision"}


def test_promotion_registers_the_export_of_the_evaluated_step(compiled):
    inner = tasks(compiled[1])
    condition = compiled[1]["components"]["comp-condition-2"]["dag"]["tasks"]
    assert set(condition) == {"export-model", "promote"}  # both only when the gate says better
    export = inner["export-model"]
    assert export["inputs"]["artifacts"]["decision"] == \
        {"componentInputArtifact": "pipelinechannel--evaluate-checkpoint-decision"}  # the step the gate evaluated
    assert inner["promote"]["dependentTasks"] == ["export-model"]
    assert inner["promote"]["inputs"]["artifacts"]["exported_model"] == \
        {"taskOutputArtifact": {"outputArtifactKey": "exported_model", "producerTask": "export-model"}}
    resources = compiled[1]["deploymentSpec"]["executors"]["exec-export-model"]["container"]["resources"]
    assert resources["resourceMemoryRequest"] == "{{$.inputs.parameters['pipelinechannel--eval_memory']}}"
    assert "accelerator" not in resources  # the export runs on CPU


def test_the_credentials_secret_is_a_run_parameter_and_optional(compiled):
    executors = compiled[2]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    (mount,) = executors["exec-data-prep"]["secretAsVolume"]
    assert mount == {"mountPath": credentials.MOUNT_DIR, "optional": True,
                     "secretNameParameter": {"componentInputParameter": "pipelinechannel--corpus_secret"}}
    others = [name for name, cfg in executors.items() if name != "exec-data-prep" and
              ("secretAsVolume" in cfg or "secretAsEnv" in cfg)]
    assert others == [], f"only data prep gets the credentials: {others}"
    params = compiled[1]["root"]["inputDefinitions"]["parameters"]
    assert params["corpus_secret"]["defaultValue"] == DEFAULT_CORPUS_SECRET  # a name, never a value


def test_kubernetes_config_where_it_belongs(compiled):
    executors = compiled[2]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == {f"exec-{n}" for n in ("validate-params", "data-prep", "train",
                                                     "evaluate-checkpoint", "export-model", "promote", "cleanup")}
    for name, cfg in executors.items():
        assert cfg["pvcMount"][0]["mountPath"] == "/mnt/shared", name
        assert cfg["pvcMount"][0]["pvcNameParameter"]["componentInputParameter"] in ("pvc_name",
                                                                                     "pipelinechannel--pvc_name")
        # The run parameter (KFP >= 2.5 resolves it first), with the compiled name for a 2.4 backend.
        (secret,) = cfg["imagePullSecret"]
        assert secret["secretName"] == PULL_SECRET, name
        assert secret["secretNameParameter"]["componentInputParameter"] in (
            "step_image_pull_secret", "pipelinechannel--step_image_pull_secret"), name
    train = executors["exec-train"]
    assert train["configMapAsEnv"][0]["configMapName"] == "train-launcher-config"
    assert train["configMapAsEnv"][0]["optional"] is True


def test_the_launcher_step_stays_on_cpu_nodes(compiled):
    """The train step only launches and watches the PyTorchJob for days: never a GPU selector, toleration or
    GPU; the GPU node selector and tolerations go to the training pods (tests/pipelines/test_train_step.py)."""
    train = compiled[2]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]
    assert train["nodeSelector"] == {
        "nodeSelectorJson": {"componentInputParameter": "pipelinechannel--launcher_node_selector"}}
    assert "tolerations" not in train
    resources = compiled[1]["deploymentSpec"]["executors"]["exec-train"]["container"]["resources"]
    assert "accelerator" not in resources
    assert resources["resourceCpuRequest"] == "250m" and resources["resourceMemoryRequest"] == "512Mi"
    platform = compiled[2]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    uses = [name for name, cfg in platform.items() if "pipelinechannel--node_selector" in str(cfg)]
    assert uses == [], f"the training pods' node_selector reaches pipeline steps: {uses}"


def test_evaluation_has_requests_and_may_use_a_gpu(compiled):
    resources = compiled[1]["deploymentSpec"]["executors"]["exec-evaluate-checkpoint"]["container"]["resources"]
    assert resources["resourceCpuRequest"] == "{{$.inputs.parameters['pipelinechannel--eval_cpu']}}"
    assert resources["resourceMemoryRequest"] == "{{$.inputs.parameters['pipelinechannel--eval_memory']}}"
    assert resources["accelerator"] == {"resourceCount": "{{$.inputs.parameters['pipelinechannel--eval_gpus']}}",
                                        "resourceType": "nvidia.com/gpu", "type": "nvidia.com/gpu"}
    evaluate = compiled[2]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-evaluate-checkpoint"]
    assert evaluate["tolerations"] == [
        {"tolerationJson": {"componentInputParameter": "pipelinechannel--tolerations"}}]
    # Limits as well as requests: a namespace whose ResourceQuota covers limits refuses a pod without them.
    assert resources["resourceCpuLimit"] == resources["resourceCpuRequest"]
    assert resources["resourceMemoryLimit"] == resources["resourceMemoryRequest"]
    params = compiled[1]["root"]["inputDefinitions"]["parameters"]
    assert params["eval_cpu"]["defaultValue"] == PipelineParams().eval_cpu
    assert params["eval_memory"]["defaultValue"] == PipelineParams().eval_memory


def test_step_pull_secrets_are_run_parameters(tmp_path):
    """Several compiled secrets: the first is the run parameter, the rest stay as compiled (KFP resolves a pull
    secret from one string parameter, never from a list); none compiled: the step pods name none, so they
    keep their ServiceAccount's imagePullSecrets."""
    path = compile_pipeline(tmp_path / "p.yaml", image=IMAGE, image_pull_secrets=["a", "b"], version=VERSION)
    _, platform = yaml.safe_load_all(path.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    first, second = executors["exec-data-prep"]["imagePullSecret"]
    assert first["secretNameParameter"] == {"componentInputParameter": "pipelinechannel--step_image_pull_secret"}
    assert second == {"secretName": "b", "secretNameParameter": {"runtimeValue": {"constant": "b"}}}
    path = compile_pipeline(tmp_path / "q.yaml", image=IMAGE, version=VERSION)
    spec, platform = yaml.safe_load_all(path.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert not [name for name, cfg in executors.items() if "imagePullSecret" in cfg]
    assert spec["root"]["inputDefinitions"]["parameters"]["step_image_pull_secret"]["defaultValue"] == ""


def test_image_and_version_are_stamped(compiled):
    spec = compiled[1]
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["image"]["defaultValue"] == IMAGE
    assert params["image_pull_secrets"]["defaultValue"] == [PULL_SECRET]
    assert params["step_image_pull_secret"]["defaultValue"] == PULL_SECRET
    assert tasks(spec)["validate-params"]["inputs"]["parameters"]["compiled_pull_secrets"] == {
        "runtimeValue": {"constant": [PULL_SECRET]}}
    assert f"Built from resilient-train {VERSION} for image {IMAGE}" in spec["pipelineInfo"]["description"]
    check = tasks(spec)["validate-params"]["inputs"]["parameters"]["compiled_version"]
    assert check == {"runtimeValue": {"constant": VERSION}}
    assert "ghcr.io" not in compiled[0], "a placeholder image is baked into the YAML"


def test_compile_needs_an_image_and_rejects_a_bad_one(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("IMAGE", raising=False)
    assert main(["--out", str(tmp_path / "p.yaml")]) == 2
    assert "pass --image" in capsys.readouterr().err and not (tmp_path / "p.yaml").exists()
    assert main(["--out", str(tmp_path / "p.yaml"), "--image", "my image:latest"]) == 2
    assert "not a valid image reference" in capsys.readouterr().err
    assert main(["--print-version"]) == 0
    assert capsys.readouterr().out.startswith(package_version())


def test_every_step_runs_the_image_parameter(compiled):
    for name, ex in compiled[1]["deploymentSpec"]["executors"].items():
        assert ex["container"]["image"] == "{{$.inputs.parameters['pipelinechannel--image']}}", name
        assert not any("pip install" in a for a in ex["container"]["command"]), "the image holds kfp already"


def test_parameters_have_descriptions_and_the_defaults(compiled):
    params = compiled[1]["root"]["inputDefinitions"]["parameters"]
    fields = PipelineParams.__dataclass_fields__
    assert set(params) == set(fields)
    for name, p in params.items():
        assert p.get("description"), f"{name} has no description in the UI"
    assert params["steps"]["defaultValue"] == PipelineParams().steps


def test_components_take_every_parameter():
    from components.train import train
    from components.validate import validate_params

    fields = set(PipelineParams.__dataclass_fields__)
    assert set(validate_params.component_spec.inputs) == fields | {"compiled_version", "compiled_pull_secrets"}
    assert set(train.component_spec.inputs) == fields | {"run_id", "dataset"}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_rooms_import_only_what_they_may():
    for path in (REPO / "components").rglob("*.py"):
        assert not imports(path) & {"torch", "trainer"}, f"{path} imports torch or the trainer"
    for path in (REPO / "pipelines").glob("*.py"):
        others = imports(path) - {"kfp", "components", "pipelines"} - set(sys.stdlib_module_names)
        assert not others, f"{path} imports {others}: pipelines/ may import only kfp, components and the stdlib"


MAX_LINES = 600


def test_no_project_file_is_over_600_lines():
    """The house rule, for every file of the project's own code, tests, benchmarks and docs (vendored CRD schemas,
    the golden YAML and recorded benchmark output are data, not code)."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=False)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    data = ("deploy/crds/", "tests/pipelines/golden/", "bench/results/")
    code = [REPO / name for name in tracked.stdout.splitlines()
            if name.endswith((".py", ".sh", ".md", ".toml", ".yaml", ".yml", "Makefile", "Dockerfile"))
            and not name.startswith(data)]
    long = {str(p.relative_to(REPO)): n for p in code if p.is_file() and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split along a seam that is there): {long}"


def test_compile_cli_writes_yaml(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "x" / "p.yaml"), "--image", IMAGE]) == 0
    spec, _ = yaml.safe_load_all((tmp_path / "x" / "p.yaml").read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["image"]["defaultValue"] == IMAGE


def make(*args: str) -> subprocess.CompletedProcess:
    """``make ARGS`` in the repository with this interpreter, without re-running ``make setup``."""
    return subprocess.run(["make", "-C", str(REPO), "-o", ".venv/.installed", f"PY={sys.executable}", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_make_compile_writes_the_pipeline_for_an_image(tmp_path):
    out = tmp_path / "p.yaml"
    done = make("compile", f"IMAGE={IMAGE}", f"PULL_SECRET={PULL_SECRET}", f"PIPELINE={out}")
    assert done.returncode == 0, done.stderr
    spec, platform = yaml.safe_load_all(out.read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["image"]["defaultValue"] == IMAGE
    assert "imagePullSecret" in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]
    missing = make("compile", "IMAGE=", f"PIPELINE={tmp_path / 'q.yaml'}")
    assert missing.returncode != 0 and "set IMAGE=" in missing.stderr and not (tmp_path / "q.yaml").exists()


def test_make_bench_runs_the_documented_benchmark():
    dry = make("-n", "bench")
    assert dry.returncode == 0, dry.stderr
    command = " ".join(dry.stdout.replace("\\\n", " ").split())
    documented = "bench/checkpoint_bench.py --config tiny --steps 20 --every 5 --persist-every 2 --model.vocab_size=2048"
    assert documented in command and documented in (REPO / "BENCHMARKS.md").read_text()
    assert (REPO / "bench" / "checkpoint_bench.py").is_file()
