"""The train step: one interface, three backends (a PyTorchJob or a Kubeflow Trainer v2 TrainJob on the
cluster, a subprocess locally).

`run_train` builds the trainer's command line from the pipeline parameters and the run's layout, runs it
with the chosen backend, and reads what the trainer left in the run directory (summary, recovery ledger,
checkpoints) into a `TrainOutcome`. Both backends honour the same cluster-layer policy: exit >= 128 is
restarted while ``max_cluster_restarts`` remains, 1-127 fails at once; when a backend gives up, the step
fails and the pipeline's ``set_retry`` starts a new attempt, which resumes from the run's checkpoints
because every path derives from ``(workdir, run_id)``. Each attempt records its outcome (the trainer's exit
code) in ``<run>/launcher/attempts.jsonl`` on the shared volume; a retry after a permanent code (1-127) ends
at once without launching anything (`refuse_permanent_retry`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, TextIO

from components.lib.evaluation import read_registry
from components.lib.layout import RunLayout
from components.lib.local_launcher import RETRYABLE_MIN, exit_name
from components.lib.params import INIT_FROM_PROMOTED, SHARED_MOUNT, PipelineParams, is_model_uri
from components.lib.report import read_jsonl, summarize_ledger

log = logging.getLogger(__name__)

TRAIN_STEP_NAME = "train"
ATTEMPTS_FILE = "attempts.jsonl"
KUEUE_QUEUE_ENV = "KUEUE_QUEUE_NAME"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def configure_step_logging() -> None:
    """Show this project's INFO events (job created, state changes, success) in the step log; the launcher
    keeps WARNING for failures, restarts and retries."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("components").setLevel(logging.INFO)


class TrainStepError(RuntimeError):
    """The train step cannot succeed as configured; the message says why."""


class PermanentFailureError(TrainStepError):
    """An earlier attempt of this run's train step ended with a permanent trainer exit code (1-127): a
    retry cannot fix it, so this attempt ends before launching anything; `exit_code` is that code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def trainer_args(p: PipelineParams, layout: RunLayout, data_dir: str, init_from_dir: str = "",
                 base_model: str | None = None) -> list[str]:
    """The trainer CLI (``python -m trainer`` / the entrypoint) for this run; overrides last. ``base_model`` is
    where the training pods find the base model (the backend's `TrainBackend.base_model_path`; default: the
    parameter as it is)."""
    args = [
        "--config", p.model,
        f"--data.path={data_dir}",
        f"--train.run_dir={layout.run_dir}",
        f"--checkpoint.dir={layout.checkpoint_dir}",
        f"--train.steps={p.steps}",
        f"--checkpoint.interval={p.checkpoint_interval}",
        f"--train.device={'cuda' if p.gpus_per_node > 0 else 'cpu'}",
        f"--resiliency.inprocess={'true' if p.inprocess_restart else 'false'}",
    ]
    if p.faults.strip():
        args.append(f"--resiliency.faults={p.faults.replace(' ', '')}")
    if p.seq_len:
        args.append(f"--data.seq_len={p.seq_len}")
    if p.batch_size:
        args.append(f"--train.batch_size={p.batch_size}")
    if init_from_dir:
        args.append(f"--checkpoint.init_from={init_from_dir}")
    base_model = p.base_model if base_model is None else base_model
    if base_model:
        args.append(f"--model.from_hf={base_model}")
    return args + list(p.trainer_overrides)


def resolve_init_from(p: PipelineParams, out: TextIO = sys.stdout) -> str:
    """The checkpoint directory to warm-start from ('' for none)."""
    if p.init_from != INIT_FROM_PROMOTED:
        return p.init_from
    record = read_registry(p.registry_path())
    if not record or not record.get("checkpoint_dir"):
        out.write(f"[train] init_from=promoted: nothing promoted yet in {p.registry_path()}; training from scratch\n")
        return ""
    out.write(f"[train] warm start from the promoted model: {record['checkpoint_dir']} (step {record.get('step')}, "
              f"val loss {record.get('val_loss')})\n")
    return str(record["checkpoint_dir"])


@dataclass
class BackendRun:
    """What a backend reports about the job it ran."""

    relaunches: int
    """Cluster-layer restarts the backend itself performed (pod restarts, local relaunches)."""
    detail: dict[str, Any] = field(default_factory=dict)


class TrainBackend(Protocol):
    name: str

    def base_model_path(self, p: PipelineParams) -> str:
        """What the trainer's ``--model.from_hf`` is on this backend ('' = no base model)."""
        ...

    def run(self, p: PipelineParams, layout: RunLayout, args: list[str], out: TextIO) -> BackendRun: ...

    def cleanup(self, p: PipelineParams, layout: RunLayout) -> str: ...


class LocalBackend:
    """Runs the entrypoint as a subprocess on this machine (`components.lib.local_launcher`)."""

    name = "local"

    def __init__(self, entrypoint: Path | None = None, relaunch_delay_s: float = 1.0) -> None:
        self.entrypoint, self.relaunch_delay_s = entrypoint, relaunch_delay_s

    def base_model_path(self, p: PipelineParams) -> str:
        """The parameter: the trainer loads the directory or downloads the URI (credentials from the environment)."""
        return p.base_model

    def run(self, p: PipelineParams, layout: RunLayout, args: list[str], out: TextIO) -> BackendRun:
        from components.lib.local_launcher import ECHO_ALL, ECHO_ENV, LocalJobSpec, LocalLauncher

        spec = LocalJobSpec(
            args=args, nodes=p.nodes, spare_nodes=p.spare_nodes, min_nodes=p.min_nodes,
            nproc_per_node=p.procs_per_rank_node,
            ft_max_restarts=p.ft_max_restarts,
            max_cluster_restarts=p.max_cluster_restarts, state_dir=layout.launcher_dir, total_steps=p.steps,
            entrypoint=self.entrypoint, deadline_s=p.deadline_hours * 3600, relaunch_delay_s=self.relaunch_delay_s,
            echo=os.environ.get(ECHO_ENV, ECHO_ALL))
        result = LocalLauncher(out).run(spec)
        return BackendRun(result.relaunches, {"launches": [vars(x) for x in result.launches]})

    def cleanup(self, p: PipelineParams, layout: RunLayout) -> str:
        from components.lib.local_launcher import kill_leftovers

        killed = kill_leftovers(layout.launcher_dir)
        return f"killed {killed} leftover local training process(es)" if killed else "no local training processes left"


class PyTorchJobBackend:
    """Submits a PyTorchJob and waits (`components.lib.k8s_launcher`); the pods mount the shared PVC."""

    name = "pytorchjob"
    kind = "PyTorchJob"

    def __init__(self, launcher_factory: Callable[[], Any] | None = None) -> None:
        self._factory = launcher_factory

    def base_model_path(self, p: PipelineParams) -> str:
        """The parameter: a directory on the shared volume, or a URI each node's local rank 0 downloads."""
        return p.base_model

    def _launcher(self) -> Any:
        if self._factory:
            return self._factory()
        from components.lib import k8s_launcher

        launcher = {"pytorchjob": k8s_launcher.PyTorchJobLauncher, "trainjob": k8s_launcher.TrainJobLauncher}
        return launcher[self.name].from_environment()

    def spec(self, p: PipelineParams, layout: RunLayout, args: list[str]) -> Any:
        from components.lib.pytorchjob import TrainJobSpec, job_name

        queue = os.environ.get(KUEUE_QUEUE_ENV, "").strip()
        return TrainJobSpec(
            name=job_name(layout.run_id, TRAIN_STEP_NAME), image=p.image, args=args, namespace=namespace(p),
            nodes=p.nodes, spare_nodes=p.spare_nodes, min_nodes=p.min_nodes, nproc_per_node=p.procs_per_rank_node,
            gpus_per_node=p.gpus_per_node,
            pvc_name=p.pvc_name, mount_path=SHARED_MOUNT, node_selector=dict(p.node_selector),
            tolerations=list(p.tolerations), image_pull_secrets=list(p.image_pull_secrets),
            ft_max_restarts=p.ft_max_restarts,
            max_cluster_restarts=p.max_cluster_restarts, active_deadline_seconds=int(p.deadline_hours * 3600),
            labels={KUEUE_LABEL: queue} if queue else {},
            credentials_secret=p.corpus_secret if is_model_uri(p.base_model) else None)

    def run(self, p: PipelineParams, layout: RunLayout, args: list[str], out: TextIO) -> BackendRun:
        spec = self.spec(p, layout, args)
        spares = f" and {spec.spare_nodes} spare(s)" if spec.spare_nodes else ""
        spares += f", going on with {spec.min_nodes} or more" if 0 < spec.min_nodes < spec.nodes else ""
        out.write(f"[train] {self.kind} {spec.namespace}/{spec.name}: {spec.nodes} node(s) x {spec.nproc_per_node} "
                  f"rank(s){spares}, image {spec.image}\n")
        result = self._launcher().run(spec)
        return BackendRun(result.restarts, {"job": result.name, "namespace": result.namespace,
                                            "duration_s": round(result.duration_s, 1)})

    def cleanup(self, p: PipelineParams, layout: RunLayout) -> str:
        from components.lib.pytorchjob import job_name

        name, ns = job_name(layout.run_id, TRAIN_STEP_NAME), namespace(p)
        deleted = self._launcher().delete(name, ns)
        return f"deleted {self.kind} {ns}/{name}" if deleted else f"{self.kind} {ns}/{name} was already gone"


class TrainJobBackend(PyTorchJobBackend):
    """Submits a Kubeflow Trainer v2 TrainJob on our ClusterTrainingRuntime and waits (same launcher). A base
    model URI is downloaded by Trainer's model initializer into the run's workspace (`RunLayout.workspace_dir`,
    mounted at /workspace), not by the trainer."""

    name = "trainjob"
    kind = "TrainJob"

    def base_model_path(self, p: PipelineParams) -> str:
        from components.lib.trainjob import MODEL_PATH

        return MODEL_PATH if is_model_uri(p.base_model) else p.base_model

    def spec(self, p: PipelineParams, layout: RunLayout, args: list[str]) -> Any:
        from components.lib.pytorchjob import ModelInitializer

        spec = super().spec(p, layout, args)
        if not is_model_uri(p.base_model):
            return spec
        subpath = str(PurePosixPath(str(layout.workspace_dir)).relative_to(SHARED_MOUNT))
        return dataclasses.replace(spec, model_initializer=ModelInitializer(p.base_model, subpath))

    def run(self, p: PipelineParams, layout: RunLayout, args: list[str], out: TextIO) -> BackendRun:
        if is_model_uri(p.base_model):
            # Made by this step (the image's user) so the initializer, running as the same user, can write into
            # it: a directory the kubelet creates for a subPath would be root's.
            (layout.workspace_dir / "model").mkdir(parents=True, exist_ok=True)
            out.write(f"[train] the model initializer downloads {p.base_model} into {layout.workspace_dir}/model\n")
        return super().run(p, layout, args, out)


def namespace(p: PipelineParams) -> str:
    """The PyTorchJob's namespace: the parameter, else the step pod's own namespace, else ``default``."""
    if p.namespace:
        return p.namespace
    try:
        return SA_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def backend_for(name: str) -> TrainBackend:
    backends: dict[str, Callable[[], TrainBackend]] = {"local": LocalBackend, "pytorchjob": PyTorchJobBackend,
                                                       "trainjob": TrainJobBackend}
    if name not in backends:
        raise TrainStepError(f"backend must be one of {sorted(backends)}; got {name!r}")
    return backends[name]()


@dataclass
class TrainOutcome:
    """What the trainer left behind, for the Model and Metrics artifacts."""

    checkpoint_dir: str
    step: int
    model: str
    run_dir: str
    metrics: dict[str, float]
    detail: dict[str, Any]


def _record_attempt(layout: RunLayout, record: dict[str, Any]) -> None:
    layout.launcher_dir.mkdir(parents=True, exist_ok=True)
    with open(layout.launcher_dir / ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


def step_attempts(layout: RunLayout) -> int:
    """How many times the train step has started for this run (1 + pipeline retries)."""
    records, _ = read_jsonl(layout.launcher_dir / ATTEMPTS_FILE)
    return sum(1 for r in records if r.get("event") == "begin")


def permanent_failure(layout: RunLayout) -> dict[str, Any] | None:
    """The previous attempt's end record when it failed with a permanent trainer exit code (1-127), else None.

    FT: KFP's ``set_retry`` retries every failure of the step and cannot filter on the exit code; this is the
    filter. Only the newest end record counts, and codes >= 128 (201 unhealthy node, 204 launcher lost too)
    stay retryable by the exit-code contract."""
    records, _ = read_jsonl(layout.launcher_dir / ATTEMPTS_FILE)
    ends = [r for r in records if r.get("event") == "end"]
    code = ends[-1].get("exit_code") if ends else None
    return ends[-1] if isinstance(code, int) and 0 < code < RETRYABLE_MIN else None


def collect_outcome(p: PipelineParams, layout: RunLayout, backend_run: BackendRun | None = None) -> TrainOutcome:
    """Read summary.json, metrics.jsonl and recovery.jsonl of a finished run."""
    summary_path = layout.run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainStepError(f"training reported success but {summary_path} is missing or unreadable ({exc}); "
                             "the run directory is not where the trainer wrote") from exc
    ledger, bad = read_jsonl(layout.run_dir / "recovery.jsonl")
    recovery = summarize_ledger(ledger)
    step = int(summary.get("steps", 0))
    if step < p.steps:
        raise TrainStepError(f"training stopped at step {step} of {p.steps} ({summary_path}) yet exited 0")
    start = next((r for r in read_jsonl(layout.run_dir / "metrics.jsonl")[0] if r.get("event") == "start"), {})
    metrics = {
        "steps": float(step),
        "tokens": float(summary.get("tokens", 0)),
        # none when the last attempt resumed at the last step and trained none
        "final_loss": float("nan") if summary.get("final_loss") is None else float(summary["final_loss"]),
        "wall_time_s": round(float(summary.get("wall_time_s", 0.0)), 3),
        **{f"restarts_{layer}": float(n) for layer, n in recovery["restarts"].items()},
        "faults": float(recovery["faults"]),
        "steps_redone": float(recovery["steps_redone"]),
        "size_changes": float(recovery["size_changes"]),  # elastic: the job shrank or grew back (min_nodes)
        "step_attempts": float(step_attempts(layout)),
    }
    if recovery["goodput"] is not None:
        metrics["goodput"] = recovery["goodput"]
    detail = {"recovery": recovery, "unreadable_ledger_lines": bad,
              "backend": backend_run.detail if backend_run else {},
              "backend_relaunches": backend_run.relaunches if backend_run else 0}
    return TrainOutcome(str(layout.checkpoint_dir), step, str(start.get("model", p.model)), str(layout.run_dir),
                        metrics, detail)


def refuse_permanent_retry(layout: RunLayout, run_id: str, attempt: int, backend: str) -> None:
    """Raise `PermanentFailureError` (recorded, so later retries end the same way) when the previous attempt
    of this run failed for good; it names the code and what to do, in one line."""
    failed = permanent_failure(layout)
    if failed is None:
        return
    code = int(failed["exit_code"])
    origin = failed.get("failed_attempt", failed.get("attempt", "?"))  # the attempt that ran the job
    message = (f"[train] not relaunching: attempt {origin} of run {run_id} ended with exit "
               f"{exit_name(code)}, which a retry cannot fix; fix the cause and start a new run (to retry this "
               f"run anyway, delete {layout.launcher_dir / ATTEMPTS_FILE})")
    _record_attempt(layout, {"event": "begin", "attempt": attempt, "backend": backend, "skipped": True})
    _record_attempt(layout, {"event": "end", "attempt": attempt, "ok": False, "exit_code": code,
                             "failed_attempt": origin, "error": f"not relaunched after exit {code} of attempt {origin}"})
    raise PermanentFailureError(message, code)


def run_train(p: PipelineParams, run_id: str, data_dir: str, backend: TrainBackend | None = None,
              out: TextIO = sys.stdout) -> TrainOutcome:
    """Validate, run the backend, and collect the outcome; raises when training failed."""
    p.validate()
    layout = RunLayout(Path(p.workdir), run_id)
    backend = backend or backend_for(p.backend)
    for d in (layout.run_dir, layout.checkpoint_dir, layout.launcher_dir):
        d.mkdir(parents=True, exist_ok=True)
    attempt = step_attempts(layout) + 1
    refuse_permanent_retry(layout, run_id, attempt, backend.name)
    resuming = any(layout.checkpoint_dir.iterdir())
    out.write(f"[train] run {run_id}, attempt {attempt} of the train step, backend {backend.name}; "
              f"{'resuming from ' + str(layout.checkpoint_dir) if resuming else 'no checkpoint yet'}\n")
    args = trainer_args(p, layout, data_dir, resolve_init_from(p, out), backend.base_model_path(p))
    _record_attempt(layout, {"event": "begin", "attempt": attempt, "backend": backend.name, "args": args})
    try:
        run = backend.run(p, layout, args, out)
    except BaseException as exc:
        code = getattr(exc, "exit_code", None)  # the trainer's, from JobFailedError or LocalLaunchError
        _record_attempt(layout, {"event": "end", "attempt": attempt, "ok": False,
                                 "exit_code": code if isinstance(code, int) else None,
                                 "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
        raise
    _record_attempt(layout, {"event": "end", "attempt": attempt, "ok": True, "relaunches": run.relaunches})
    return collect_outcome(p, layout, run)
