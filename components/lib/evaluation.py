"""Checkpoint evaluation through the trainer's CLI, and the promotion gate with its registry file.

`run_evaluation` runs ``python -m trainer.evaluate`` (the trainer owns model loading; this module never
imports torch or the trainer) and checks its ``result.json``. The promoted model is one small JSON record
on shared storage (`read_registry` / `write_registry`, atomic, locked, with a history file next to it).
`decide` compares a candidate with it only on equal terms: the same tokenizer, and the same validation
data — re-evaluating the promoted checkpoint on this run's data when the data differ.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlparse

from components.lib.promoted import PromotedRecord, PromotionConflict, record_id
from components.lib.registry import ModelRegistryStore, is_model_registry

__all__ = ["PromotionConflict", "record_id"]  # re-exported: promotion's callers import them from here

EVAL_MODULE = "trainer.evaluate"
#: trainer.exitcodes.ExitCode.CHECKPOINT_ERROR: no valid checkpoint to evaluate.
NO_CHECKPOINT_EXIT = 4
RESULT_KEYS = {"step": int, "val_loss": float, "perplexity": float, "val_tokens": int, "checkpoint": str,
               "model": str}
LOG_TAIL_LINES = 30


class EvaluationError(RuntimeError):
    """The evaluation CLI failed or wrote an unusable result."""


class NoCheckpointError(EvaluationError):
    """The checkpoint directory holds no valid checkpoint (exit 4)."""


def run_evaluation(checkpoint_dir: str | Path, data_dir: str | Path, out_path: str | Path, *, batch_size: int,
                   max_batches: int, python: str = sys.executable, timeout_s: float | None = None,
                   out: TextIO | None = None) -> dict[str, Any]:
    """Run the evaluation CLI, stream its output, and return its validated ``result.json``."""
    out = out or sys.stdout
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)
    cmd = [python, "-m", EVAL_MODULE, "--checkpoint-dir", str(checkpoint_dir), "--data", str(data_dir),
           "--batch-size", str(batch_size), "--max-batches", str(max_batches), "--out", str(out_path)]
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:  # noqa: S603 - argument list
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            out.write(line)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise EvaluationError(f"evaluation of {checkpoint_dir} did not finish within {timeout_s} s") from None
    log_tail = "\n".join(tail)
    if code == NO_CHECKPOINT_EXIT:
        raise NoCheckpointError(f"no valid checkpoint in {checkpoint_dir} (exit {code}):\n{log_tail}")
    if code != 0:
        raise EvaluationError(f"evaluation of {checkpoint_dir} exited {code}:\n{log_tail}")
    try:
        result = json.loads(out_path.read_text())
    except (OSError, ValueError) as exc:
        raise EvaluationError(f"evaluation exited 0 but {out_path} is missing or not JSON ({exc})") from exc
    return check_result(result)


def check_result(result: Any) -> dict[str, Any]:
    """The result with the contract's keys and types, or EvaluationError naming what is wrong."""
    if not isinstance(result, dict):
        raise EvaluationError(f"evaluation result must be a JSON object; got {type(result).__name__}")
    problems = []
    for key, kind in RESULT_KEYS.items():
        value = result.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else \
            isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            problems.append(f"{key} must be {kind.__name__}; got {value!r}")
    if problems:
        raise EvaluationError("evaluation result breaks the contract: " + "; ".join(problems))
    return {**result, "val_loss": float(result["val_loss"]), "perplexity": float(result["perplexity"])}


# --- data identity --------------------------------------------------------------------------------------
def data_identity(manifest: Mapping[str, Any]) -> dict[str, str]:
    """What makes two val losses comparable: the tokenizer and the validation shards (by checksum)."""
    val = [e.get("sha256", "") for e in (manifest.get("splits") or {}).get("val", [])]
    return {"tokenizer_sha256": str(manifest.get("tokenizer_sha256", "")),
            "val_sha256": hashlib.sha256("\n".join(val).encode()).hexdigest() if val else ""}


# --- the registry ---------------------------------------------------------------------------------------
def checkpoint_data_dir(checkpoint_dir: str | Path) -> str:
    """The dataset directory a run's checkpoints were trained on, from the newest committed checkpoint's
    ``manifest.json`` (``config.data.path``; layout: ``trainer_image/trainer/CHECKPOINTS.md``)."""
    directory = Path(checkpoint_dir)
    committed = sorted(p for p in directory.glob("step-*") if p.name[5:].isdigit() and (p / "manifest.json").is_file())
    if not committed:
        raise EvaluationError(f"init_from {str(directory)!r} holds no committed checkpoint (step-XXXXXXXX/manifest.json)")
    manifest = json.loads((committed[-1] / "manifest.json").read_text())
    return str(manifest.get("config", {}).get("data", {}).get("path", ""))


def registry_path(uri: str) -> Path:
    """A registry location (absolute path or ``file://`` URI) as a local path."""
    if "://" in uri:
        parsed = urlparse(uri)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise ValueError(f"promoted_registry {uri!r}: only paths and file:///abs/path URIs are supported; "
                             "put the record on the shared volume")
        return Path(unquote(parsed.path))
    return Path(uri)


def read_registry(uri: str) -> dict[str, Any] | None:
    """The promoted record, or None when nothing has been promoted yet (a Model Registry address reads the
    registry: `components.lib.registry`)."""
    if is_model_registry(uri):
        return ModelRegistryStore(uri).read()
    path = registry_path(uri)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"promoted record {path} is not valid JSON ({exc}); fix or remove it") from exc
    if not isinstance(record, dict):
        raise ValueError(f"promoted record {path} must be a JSON object; fix or remove it")
    return record


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_registry(uri: str, record: Mapping[str, Any], expected_current: str) -> Path | str:
    """Atomically replace the promoted record if it is still ``expected_current``; append to the history.
    A Model Registry address registers a new model version instead (`components.lib.registry`)."""
    if is_model_registry(uri):
        return ModelRegistryStore(uri).write(record, expected_current)
    path = registry_path(uri)
    promoted = PromotedRecord.from_mapping(record)
    with _locked(path):
        current = record_id(read_registry(uri))
        if current != expected_current:
            raise PromotionConflict(f"the promoted model changed since the gate compared against it "
                                    f"({expected_current or 'none'} -> {current or 'none'}); not overwriting")
        stamped = promoted.stamped().to_dict()
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(stamped, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with open(path.with_name(path.name + ".history.jsonl"), "a") as history:
            history.write(json.dumps(stamped, sort_keys=True) + "\n")
    return path


# --- the gate -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    baseline_val_loss: float | None
    current_id: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(candidate: Mapping[str, Any], current: Mapping[str, Any] | None, min_improvement: float,
           reevaluate: Callable[[Mapping[str, Any]], float]) -> Decision:
    """Whether ``candidate`` (an evaluation + data identity) beats the promoted ``current`` record.

    ``reevaluate(current)`` returns the promoted checkpoint's val loss on the candidate's data; it is
    called only when the tokenizer matches but the validation data differ, and may raise EvaluationError.
    """
    loss = candidate["val_loss"]
    cid = record_id(current)
    if not math.isfinite(loss):
        return Decision(False, f"not promoted: val loss is {loss}", None, cid)
    if not current:
        return Decision(True, f"promoted (first model of this name; val loss {loss:.4f})", None, cid)
    who = f"the promoted model ({current.get('model')} step {current.get('step')}, run {current.get('run_id')})"
    if current.get("tokenizer_sha256") != candidate.get("tokenizer_sha256"):
        return Decision(False, f"not promoted: {who} uses another tokenizer, so val losses are not comparable; "
                               "build the data with its tokenizer, or remove the registry record to promote "
                               "this model", None, cid)
    if current.get("val_sha256") == candidate.get("val_sha256") and _finite(current.get("val_loss")):
        baseline = float(current["val_loss"])
        basis = "on the same validation data"
    else:
        try:
            baseline = float(reevaluate(current))
        except EvaluationError as exc:
            first = str(exc).splitlines()[0]
            return Decision(True, f"promoted: {who} could not be evaluated on this run's data ({first}); "
                                  f"replacing it (val loss {loss:.4f})", None, cid)
        basis = "re-evaluated on this run's validation data"
    if loss < baseline - min_improvement:
        return Decision(True, f"promoted: val loss {loss:.4f} beats {who}'s {baseline:.4f} {basis} "
                              f"(margin {min_improvement})", baseline, cid)
    return Decision(False, f"not promoted: val loss {loss:.4f} does not beat {who}'s {baseline:.4f} {basis} "
                           f"by more than {min_improvement}", baseline, cid)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --- the evaluate step ----------------------------------------------------------------------------------
@dataclass
class EvalOutcome:
    result: dict[str, Any]
    decision: Decision
    candidate: dict[str, Any]
    """The `PromotedRecord` (as a dict) that ``promote`` stores, with its export, if the model is promoted."""
    report_html: str


def evaluate_and_gate(*, checkpoint: Mapping[str, Any], dataset: Mapping[str, Any], registry: str, run_id: str,
                      eval_dir: str | Path, batch_size: int, max_batches: int, min_improvement: float,
                      out: TextIO | None = None, planning: Mapping[str, Any] | None = None) -> EvalOutcome:
    """Evaluate the run's checkpoint, decide promotion, and render the HTML report.

    ``checkpoint`` and ``dataset`` are the Model and Dataset artifacts' metadata (checkpoint_dir, run_dir,
    step, model; data_dir, tokenizer_sha256, val_sha256). ``planning``: the goodput planner's cluster settings
    (``spares``, ``gpus_per_node``, ``replacement_s``: ``components.lib.planning.plan_command``).
    """
    from components.lib.planning import CHART_FILE, plan_for_report
    from components.lib.report import read_jsonl, render_report, summarize_ledger

    eval_dir = Path(eval_dir)
    result = run_evaluation(checkpoint["checkpoint_dir"], dataset["data_dir"], eval_dir / "result.json",
                            batch_size=batch_size, max_batches=max_batches, out=out)
    identity = {k: dataset.get(k, "") for k in ("tokenizer_sha256", "val_sha256")}
    candidate = PromotedRecord(
        checkpoint_dir=checkpoint["checkpoint_dir"], step=result["step"], model=result["model"],
        val_loss=result["val_loss"], perplexity=result["perplexity"], val_tokens=result["val_tokens"],
        checkpoint=result["checkpoint"], run_id=run_id, data_dir=dataset["data_dir"], **identity).to_dict()

    def reevaluate(current: Mapping[str, Any]) -> float:
        baseline = run_evaluation(current["checkpoint_dir"], dataset["data_dir"], eval_dir / "baseline.json",
                                  batch_size=batch_size, max_batches=max_batches, out=out)
        return baseline["val_loss"]

    decision = decide(candidate, read_registry(registry), min_improvement, reevaluate)
    run_dir = Path(checkpoint.get("run_dir", ""))
    metrics, _ = read_jsonl(run_dir / "metrics.jsonl")
    ledger, bad = read_jsonl(run_dir / "recovery.jsonl")
    candidate["goodput"] = summarize_ledger(ledger)["goodput"]  # None when the ledger has no timing
    # a planner failure is a note, not a failure
    plan, plan_note = plan_for_report(run_dir, eval_dir / "planner", **dict(planning or {}))
    planning = (plan, _read_bytes(eval_dir / "planner" / CHART_FILE)) if plan else None
    html_text = render_report(
        title=f"Training run {run_id}: {result['model']} at step {result['step']}",
        metrics=metrics, ledger=ledger,
        evaluation={k: result[k] for k in ("step", "val_loss", "perplexity", "val_tokens", "checkpoint", "model")},
        decision=decision.to_dict(),
        run_info={"run id": run_id, "run directory": str(run_dir), "dataset": dataset["data_dir"],
                  "promoted registry": registry},
        notes=([f"{bad} unreadable line(s) in recovery.jsonl were skipped"] if bad else [])
        + ([f"goodput at scale: not projected ({plan_note})"] if plan_note else []), planning=planning)
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / "report.html").write_text(html_text)
    (eval_dir / "decision.json").write_text(json.dumps(decision.to_dict(), indent=2) + "\n")
    return EvalOutcome(result, decision, candidate, html_text)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
