"""The export step: the checkpoint step the gate evaluated -> a Hugging Face directory that servers load as it is.

`export_candidate` runs ``python -m trainer.export <step dir> <out dir> --dtype D`` (the trainer owns its
checkpoint layout and the name mapping; this module never imports torch or the trainer) into a temporary
sibling of ``<workdir>/<run id>/export/step-XXXXXXXX``, checks what the CLI wrote (`check_export`), and only
then renames it into place: a failed, killed or retried export never leaves a half-written directory where the
registry, KServe or a person looks.

The directory stays on the shared volume (no copy into the artifact store: an 8B export is 16 GB); the step's
``Model`` artifact holds a small ``model.json`` and metadata naming it: ``export_dir``, ``uri`` (what a server
loads: ``pvc://<claim>/<path>`` on the shared volume, `served_uri`), the format and the source checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, TextIO

from components.lib.layout import RunLayout
from components.lib.params import SHARED_MOUNT
from components.lib.promoted import MODEL_FORMAT

EXPORT_COMMAND: tuple[str, ...] = (sys.executable, "-m", "trainer.export")
"""The export CLI (contract: ``trainer.export --help``)."""
DTYPES = ("bfloat16", "float32")
LAYOUT = "huggingface"
"""Directory layout of an export: config.json, generation_config.json, safetensors, tokenizer files."""
ARCHITECTURE = "LlamaForCausalLM"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
#: trainer.exitcodes, mirrored (components never import the trainer): CONFIG_ERROR, CHECKPOINT_ERROR.
EXIT_MESSAGES = {2: "the checkpoint step directory or the arguments are not usable",
                 4: "the checkpoint's files are unreadable or corrupt"}
LOG_TAIL_LINES = 30
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


class ExportError(RuntimeError):
    """The export failed or wrote something a server could not load; the message says which."""


def served_uri(path: str | Path, pvc_name: str) -> str:
    """The URI a server loads `path` from: ``pvc://<pvc_name>/<path below the shared mount>`` on the shared volume
    (KServe's ``storageUri`` for a PersistentVolumeClaim), ``file://<path>`` elsewhere (a local run)."""
    p = PurePosixPath(str(path))
    mount = PurePosixPath(SHARED_MOUNT)
    if pvc_name and mount in p.parents:
        return f"pvc://{pvc_name}/{p.relative_to(mount)}"
    return f"file://{p}"


def run_export(step_dir: str | Path, out_dir: str | Path, dtype: str, *, command: Sequence[str] | None = None,
               timeout_s: float | None = None, out: TextIO | None = None) -> None:
    """Run the export CLI, streaming its output; ExportError with its last lines when it fails."""
    out = out or sys.stdout
    cmd = [*(command or EXPORT_COMMAND), str(step_dir), str(out_dir), "--dtype", dtype]
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
            raise ExportError(f"export of {step_dir} did not finish within {timeout_s} s") from None
    if code != 0:
        why = EXIT_MESSAGES.get(code, "the export CLI failed")
        raise ExportError(f"export of {step_dir} exited {code} ({why}):\n" + "\n".join(tail))


def _safetensors_tensors(path: Path) -> int:
    """Number of tensors in a safetensors file whose header and size agree; ExportError otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise ExportError(f"{path} is not a safetensors file (header length {length}, file {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ExportError(f"{path} has an unreadable safetensors header ({exc})") from exc
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + length + end != size:
        raise ExportError(f"{path} is truncated or padded: its header describes {8 + length + end} bytes, "
                          f"the file has {size}")
    return len(tensors)


def check_export(directory: str | Path) -> dict[str, Any]:
    """What a Hugging Face loader needs, present and consistent: config.json naming `ARCHITECTURE`, the
    tokenizer and generation config, and the weights (one safetensors file, or an index whose every shard is
    there and whole). Returns a summary (files, bytes, tensors, architecture); ExportError naming what is wrong."""
    d = Path(directory)
    missing = [name for name in REQUIRED_FILES if not (d / name).is_file()]
    if missing:
        raise ExportError(f"export {d} lacks {missing}: a Hugging Face loader needs them")
    try:
        config = json.loads((d / "config.json").read_text())
    except ValueError as exc:
        raise ExportError(f"{d / 'config.json'} is not JSON ({exc})") from exc
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ExportError(f"{d / 'config.json'} names architectures {config.get('architectures')}, not "
                          f"{ARCHITECTURE!r}")
    if (d / INDEX_FILE).is_file():
        weight_map = json.loads((d / INDEX_FILE).read_text()).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (d / s).is_file()]
        if not shards or absent:
            raise ExportError(f"{d / INDEX_FILE} names shard(s) {absent or '(none)'} that are not in the export")
    elif (d / SINGLE_FILE).is_file():
        shards = [SINGLE_FILE]
    else:
        raise ExportError(f"export {d} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors = sum(_safetensors_tensors(d / s) for s in shards)
    files = [p for p in d.rglob("*") if p.is_file()]
    return {"architecture": ARCHITECTURE, "model_type": config.get("model_type", ""), "shards": len(shards),
            "tensors": tensors, "files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def export_candidate(candidate: Mapping[str, Any], layout: RunLayout, *, pvc_name: str, dtype: str,
                     command: Sequence[str] | None = None, out: TextIO | None = None) -> dict[str, Any]:
    """Export the gate's candidate (its ``checkpoint`` step directory and ``step``) to
    ``layout.export_dir(step)``; return the Model artifact's metadata."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {list(DTYPES)}; got {dtype!r}")
    step, step_dir = int(candidate["step"]), str(candidate["checkpoint"])
    final = layout.export_dir(step)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a killed attempt's leftovers
    final.parent.mkdir(parents=True, exist_ok=True)
    run_export(step_dir, partial, dtype, command=command, out=out)
    summary = check_export(partial)
    if final.exists():  # an earlier attempt's export of the same step: replaced by this complete one
        shutil.rmtree(final)
    os.replace(partial, final)
    return {"export_dir": str(final), "uri": served_uri(final, pvc_name), "layout": LAYOUT,
            "model_format": MODEL_FORMAT[0], "model_format_version": MODEL_FORMAT[1], "dtype": dtype, "step": step,
            "source_checkpoint": step_dir, **summary}
