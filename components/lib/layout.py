"""Where one pipeline run keeps its files: ``<workdir>/<run id>/{data,train,checkpoints,eval,export,workspace,
launcher}``.

Every step of a run derives the same paths from ``(workdir, run_id)``, so a retried train step finds the
checkpoints of the attempt before it and resumes. On a cluster ``workdir`` is on the shared PVC (mounted
at the same path in the pipeline's step pods and in the PyTorchJob's pods); locally it is a directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_id(run_id: str) -> str:
    """The run id, if it is safe as one path component; else ValueError."""
    if not _RUN_ID.match(run_id or "") or run_id in (".", ".."):
        raise ValueError(
            f"run_id {run_id!r} must be 1-128 letters, digits, '.', '_' or '-' (it names a directory); "
            "pass dsl.PIPELINE_JOB_ID_PLACEHOLDER"
        )
    return run_id


@dataclass(frozen=True)
class RunLayout:
    """The directories of one pipeline run under ``workdir``."""

    workdir: Path
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        object.__setattr__(self, "workdir", Path(self.workdir))

    @property
    def root(self) -> Path:
        return self.workdir / self.run_id

    @property
    def data_dir(self) -> Path:
        """Token shards + manifest.json + tokenizer.json (data prep)."""
        return self.root / "data"

    @property
    def run_dir(self) -> Path:
        """The trainer's ``--train.run_dir``: metrics.jsonl, summary.json, recovery.jsonl."""
        return self.root / "train"

    @property
    def checkpoint_dir(self) -> Path:
        """The trainer's ``--checkpoint.dir``."""
        return self.root / "checkpoints"

    @property
    def eval_dir(self) -> Path:
        """Evaluation results and the HTML report's copy."""
        return self.root / "eval"

    def export_dir(self, step: int) -> Path:
        """The Hugging Face directory exported from checkpoint ``step`` (``export/step-XXXXXXXX``, the checkpoint's
        own step naming): what promotion registers and a server loads."""
        return self.root / "export" / f"step-{step:08d}"

    @property
    def workspace_dir(self) -> Path:
        """The TrainJob's initializer workspace (mounted at ``/workspace`` in the model initializer and the training
        pods): the model initializer downloads the base model into its ``model/``."""
        return self.root / "workspace"

    @property
    def launcher_dir(self) -> Path:
        """The train step's own records: attempts.jsonl, launcher logs, the local process-group file."""
        return self.root / "launcher"
