"""Data prep step: build the token shards under the run's layout and describe them for the Dataset artifact.

The shards go to ``<workdir>/<run id>/data`` (shared storage: the PVC on a cluster, where the PyTorchJob's
pods read them), not into the artifact store: the artifact holds ``manifest.json`` and the metadata.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from components.lib.evaluation import checkpoint_data_dir, data_identity, read_registry
from components.lib.layout import RunLayout
from components.lib.params import INIT_FROM_PROMOTED
from components.lib.tokendata import MANIFEST, build_dataset, default_corpus

#: Per-shard checksums go into the artifact metadata up to this many shards (all are in manifest.json).
MAX_LISTED_SHARDS = 64


def prepare(corpus: str, layout: RunLayout, *, vocab_size: int, max_bytes: int = 0,
            artifact_dir: str | Path | None = None, tokenizer_from: str = "", tokenizer: str = "",
            text_field: str = "text") -> dict[str, Any]:
    """Build the dataset for this run; copy its manifest into ``artifact_dir``; return the metadata.

    ``tokenizer_from`` (a dataset directory) reuses that dataset's tokenizer: a warm start must see the token
    ids its weights were trained on. ``tokenizer`` and ``text_field`` are data prep's ``--tokenizer`` and
    ``--text-field`` (CONTRACTS.md item 1; the byo-data branch implements them in ``tokendata``: until it is
    merged, ``tokenizer`` reuses one of our own tokenizer.json files and ``text_field`` is unused, since only text
    corpora are read).
    """
    del text_field  # read by the byo-data branch's JSON Lines / Parquet readers
    manifest = build_dataset(corpus or default_corpus(), layout.data_dir, vocab_size=vocab_size,
                             max_bytes=max_bytes or None, tokenizer=tokenizer_from or tokenizer or None)
    if artifact_dir is not None:
        Path(artifact_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(layout.data_dir / MANIFEST, Path(artifact_dir) / MANIFEST)
    return dataset_metadata(manifest, layout.data_dir)


def warm_start_data_dir(init_from: str, registry: str) -> str:
    """The dataset directory whose tokenizer a warm start must reuse ('' when training from scratch).

    ``init_from=promoted`` uses the promoted record's dataset; an explicit checkpoint directory uses the
    dataset named in that checkpoint's stored config (``CHECKPOINTS.md``: ``config.json`` -> data.path).
    """
    if not init_from:
        return ""
    if init_from == INIT_FROM_PROMOTED:
        record = read_registry(registry)
        return str(record.get("data_dir", "")) if record else ""
    return checkpoint_data_dir(init_from)


def dataset_metadata(manifest: dict[str, Any], data_dir: str | Path) -> dict[str, Any]:
    """Token counts, vocabulary and checksums of a manifest, flat enough for the KFP UI."""
    shards = [e for split in ("train", "val") for e in manifest["splits"][split]]
    meta: dict[str, Any] = {
        "data_dir": str(data_dir),
        "train_tokens": manifest["num_tokens"]["train"],
        "val_tokens": manifest["num_tokens"]["val"],
        "vocab_size": manifest["vocab_size"],
        "dtype": manifest["dtype"],
        "num_shards": len(shards),
        "num_documents": manifest["source"]["num_documents"],
        "corpus": manifest["source"]["corpus"],
        **data_identity(manifest),
    }
    if len(shards) <= MAX_LISTED_SHARDS:
        meta["shard_sha256"] = {e["file"]: e["sha256"] for e in shards}
    return meta
