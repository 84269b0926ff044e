"""The promoted-model record: what the gate proposes, what promotion stores, what a warm start reads.

Both stores keep the same record: the JSON file on the shared volume (`components.lib.evaluation`) and
Kubeflow Model Registry (`components.lib.registry`, as a model version's custom properties). This module is
theirs in common, so neither store imports the other.

A record names two things: the **training checkpoint** it came from (``checkpoint_dir``: the run's checkpoint
directory, which ``init_from=promoted`` warm-starts from; ``checkpoint``: the exact step directory the gate
evaluated) and the **served model** exported from that step (``export_dir``, ``model_uri``: a Hugging Face
safetensors directory that transformers, vLLM and KServe's Hugging Face runtime load as they are).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

#: Model Registry's (format name, format version) of what we register: a Hugging Face directory of safetensors.
MODEL_FORMAT = ("safetensors", "1")


class PromotionConflict(RuntimeError):
    """The promoted model changed between the gate's decision and the write."""


@dataclass(frozen=True)
class PromotedRecord:
    """One promoted (or candidate) model. Stored as a flat JSON object; unknown keys are kept by neither store."""

    checkpoint_dir: str
    """The run's checkpoint directory (``checkpoint.dir``); ``init_from=promoted`` warm-starts from it."""
    step: int
    """The evaluated (and exported) optimizer step."""
    model: str
    """Model flavour the run trained (tiny, 1b, 8b, or a TOML's name)."""
    val_loss: float
    """Mean validation cross-entropy (nats per token) on ``data_dir``'s val split."""
    perplexity: float
    """exp(val_loss)."""
    val_tokens: int
    """Validation tokens the loss was measured on."""
    checkpoint: str
    """The evaluated step directory, ``<checkpoint_dir>/step-XXXXXXXX``: the exact weights compared and exported."""
    run_id: str
    """KFP run id of the run that trained it."""
    data_dir: str
    """Token dataset it was trained on; a warm start reuses its tokenizer."""
    tokenizer_sha256: str = ""
    """Checksum of the tokenizer: losses are comparable only between equal tokenizers."""
    val_sha256: str = ""
    """Checksum of the validation shards: equal means the losses were measured on the same tokens."""
    goodput: float | None = None
    """Productive share of the run's wall time (recovery ledger); None when the ledger had no timing."""
    export_dir: str = ""
    """Hugging Face directory exported from ``checkpoint`` (``<workdir>/<run id>/export/step-XXXXXXXX``);
    empty in a candidate (the export runs after the gate) and in records promoted before exports existed."""
    model_uri: str = ""
    """Where a server loads the export from: ``pvc://<claim>/<path>`` when it is on the shared volume (a KServe
    ``storageUri``), else ``file://<path>``. It is the URI registered in Model Registry."""
    model_format: str = ""
    """``safetensors`` for an export (Model Registry's model format name); empty without one."""
    export_dtype: str = ""
    """Floating-point type of the exported weights (bfloat16, float32)."""
    promoted_at: str = ""
    """UTC time of the promotion (ISO 8601, seconds); empty in a candidate."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PromotedRecord:
        """The record in `values` (keys of other fields are ignored); ValueError naming a missing field."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if values.get(k) is None]
        if missing:
            raise ValueError(f"promoted record lacks {missing}; it was not written by this pipeline")
        kept = {k: v for k, v in values.items() if k in names}
        return cls(**{**kept, "step": int(kept["step"]), "val_tokens": int(kept["val_tokens"]),
                      "val_loss": float(kept["val_loss"]), "perplexity": float(kept["perplexity"])})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_export(self, export: Mapping[str, Any]) -> PromotedRecord:
        """This record pointing at its export (an ``export_model`` artifact's metadata); ValueError when the
        export is of another step than the one the gate evaluated."""
        if int(export["step"]) != self.step or export["source_checkpoint"] != self.checkpoint:
            raise ValueError(f"the export is of {export['source_checkpoint']} (step {export['step']}) but the gate "
                             f"evaluated {self.checkpoint} (step {self.step}); re-run the pipeline")
        return dataclasses.replace(self, export_dir=str(export["export_dir"]), model_uri=str(export["uri"]),
                                   model_format=str(export["model_format"]), export_dtype=str(export["dtype"]))

    def stamped(self) -> PromotedRecord:
        """The record as promoted now (``promoted_at`` set)."""
        return dataclasses.replace(self, promoted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


RECORD_KEYS = tuple(f.name for f in dataclasses.fields(PromotedRecord))


def record_id(record: Mapping[str, Any] | None) -> str:
    """Identity of a promoted record for compare-and-swap ("" = nothing promoted)."""
    if not record:
        return ""
    return f"{record.get('checkpoint_dir', '')}@{record.get('step', '')}"


def version_name(record: Mapping[str, Any]) -> str:
    """The Model Registry version of a record: ``<run id>-step-<step>``."""
    return f"{record['run_id']}-step-{record['step']}"


def scalar_properties(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's fields as scalar properties (Model Registry custom properties): absent, empty and NaN
    values dropped, anything not bool/int/float as a string."""
    props = {}
    for key in RECORD_KEYS:
        value = record.get(key)
        if value is None or value == "" or (isinstance(value, float) and not math.isfinite(value)):
            continue
        props[key] = value if isinstance(value, (bool, int, float)) else str(value)
    return props
