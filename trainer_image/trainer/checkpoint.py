"""Sharded checkpoints: asynchronous per-rank writes (NVRx), atomic commit, integrity checks, any-world-size load.

The on-disk layout is a contract with the evaluation step and other rooms: ``CHECKPOINTS.md`` next to this file.

One ``CheckpointManager`` per process (it owns the background writer and the host staging buffers, both of which
survive in-process restarts). Each attempt of ``train()`` brackets its use with ``bind()`` (after the new process
group exists) and ``unbind()``. The loop calls ``save(step, state)`` every step; the manager decides when a save is
due. A save:

1. stages this rank's local shards (no all-gather) into reusable host buffers - the only part that blocks the
   loop (shared memory so the writer process sees them; also page-locked on CUDA, the copy overlapping the next
   forward/backward until ``wait_for_staging()``);
2. hands the buffers to the NVRx ``AsyncCallsQueue`` writer process, which writes ``shard-R-of-N.pt`` into
   ``step-XXXXXXXX.tmp/`` (temp name, fsync, rename) and reports its size and sha256 through shared memory;
3. is committed once every rank's writer finished (checked with one tiny collective per step while a write is in
   flight): rank 0 writes ``manifest.json`` and renames the directory to ``step-XXXXXXXX``.

Only this module and the resiliency module import NVRx.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.config import CheckpointConfig
from trainer.exitcodes import ExitCode
from trainer.fileio import sha256_file
from trainer.parallel import DistEnv

log = logging.getLogger(__name__)

FORMAT = "resilient-train.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STEP_DIGITS = 8
TMP_SUFFIX = ".tmp"
CORRUPT_INFIX = ".corrupt-"
PARTIAL_SUFFIX = ".partial"
_COMMITTED_RE = re.compile(r"^step-(\d{%d})$" % STEP_DIGITS)
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"

REPORT_BYTES = 64 * 1024
"""Shared-memory buffer through which the writer process reports its outcome (JSON, length-prefixed)."""
_ALIGN_ELEMS = 64
"""Each staged tensor starts at a multiple of this many elements inside its dtype's flat buffer."""
_POLL_S = 0.005
_COMMIT_POLL_S = 0.05  # a blocking commit polls the ranks' writers this often
_ORPHAN_CHECK_S = 0.5
_EXIT_ORPHANED = 3
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

FAULT_ENV = "TRAINER_CKPT_TEST_FAULT"
"""Test hook read at each save and passed to the writer: ``slow_write:<seconds>`` (sleep after the first bytes of a
shard are written, so a test can kill mid-write) or ``enospc`` (the first write raises ENOSPC), optionally
``@<step>`` to affect only that step. Unset in production."""


def _test_fault(step: int) -> str:
    """The ``FAULT_ENV`` hook for this step (``<fault>`` or ``<fault>@<step>``); empty when unset."""
    spec = os.environ.get(FAULT_ENV, "")
    fault, _, only_step = spec.partition("@")
    return fault if not only_step or int(only_step) == step else ""


class CheckpointError(RuntimeError):
    """No valid checkpoint can be loaded, or a checkpoint cannot be written. Permanent: retrying cannot help."""

    exit_code = ExitCode.CHECKPOINT_ERROR


class CheckpointStorageError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error, writer died); the previous checkpoints are intact."""


def step_dir_name(step: int) -> str:
    return f"step-{step:0{STEP_DIGITS}d}"


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def committed_steps(directory: Path) -> list[int]:
    """Steps of the committed checkpoints in ``directory`` (not verified), ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _COMMITTED_RE.match(p.name)) and p.is_dir())


# --------------------------------------------------------------------------------------------------------------
# Flattened state: "model/<fqn>" and "optim/<fqn>/<name>" tensors (DTensors stay sharded: only local shards move).


@dataclass(frozen=True)
class Piece:
    """Where one rank's local tensor sits inside the global tensor."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool


def _local(value: torch.Tensor) -> tuple[torch.Tensor, Piece]:
    """The local tensor of a DTensor (FSDP2: Shard(0), torch.chunk-style uneven last chunk) or a plain tensor."""
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local = value.to_local()
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"DTensor local shape {tuple(local.shape)} != computed {tuple(shape)}")
        return local, Piece(tuple(value.shape), tuple(offset), tuple(shape), value.dtype, True)
    zeros = (0,) * value.ndim
    return value, Piece(tuple(value.shape), zeros, tuple(value.shape), value.dtype, False)


def _flatten(state: dict[str, Any], model_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Live tensors of the model and optimizer (the same objects training updates) and the optimizer's non-tensors."""
    if model_only:
        return {MODEL_PREFIX + k: v for k, v in get_model_state_dict(state["model"]).items()}, {}
    model_sd, optim_sd = get_state_dict(state["model"], state["optimizer"])
    live: dict[str, torch.Tensor] = {MODEL_PREFIX + k: v for k, v in model_sd.items()}
    scalars: dict[str, Any] = {}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            key = f"{OPTIM_PREFIX}{fqn}/{name}"
            if isinstance(value, torch.Tensor):
                live[key] = value
            else:
                scalars[key] = value
    groups = [{k: v for k, v in g.items()} for g in optim_sd["param_groups"]]
    return live, {"param_groups": groups, "optim_scalars": scalars}


def _rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """Per-rank non-tensor-shard state: step + RNG (TrainProgress), data position, fault-tolerance client state."""
    out = {"progress": state["progress"].state_dict(), "dataloader": state["dataloader"].state_dict()}
    if state.get("ft") is not None:  # FT: the NVRx RankMonitorClient state (learned timeouts) survives restarts
        out["ft"] = state["ft"].state_dict()
    return copy.deepcopy(out)


# --------------------------------------------------------------------------------------------------------------
# Staging buffers: one flat buffer per dtype, allocated once (shared memory; page-locked on CUDA), reused by every save.


@dataclass
class _Staging:
    layout: dict[str, tuple[torch.dtype, int, tuple[int, ...]]] = field(default_factory=dict)
    flats: dict[str, torch.Tensor] = field(default_factory=dict)
    pinned: list[int] = field(default_factory=list)
    views: dict[str, torch.Tensor] = field(default_factory=dict)

    def ensure(self, pieces: dict[str, Piece], pin: bool) -> None:
        """(Re)allocate when the set of tensors, their shapes or dtypes changed; otherwise keep the buffers."""
        layout: dict[str, tuple[torch.dtype, int, tuple[int, ...]]] = {}
        sizes: dict[torch.dtype, int] = {}
        for key, piece in pieces.items():
            start = sizes.get(piece.dtype, 0)
            layout[key] = (piece.dtype, start, piece.shape)
            numel = 1
            for n in piece.shape:
                numel *= n
            sizes[piece.dtype] = start + -(-numel // _ALIGN_ELEMS) * _ALIGN_ELEMS
        if layout == self.layout and bool(self.pinned) == pin and self.flats:
            return
        self.release()
        for dtype, numel in sizes.items():
            flat = torch.empty(max(numel, 1), dtype=dtype).share_memory_()
            if pin:
                ptr, nbytes = flat.data_ptr(), flat.numel() * flat.element_size()
                _check_cuda(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0), "cudaHostRegister")
                self.pinned.append(ptr)
            self.flats[str(dtype)] = flat
        self.layout = layout
        self.views = _views(self.flats, _layout_spec(layout))
        log.info("checkpoint staging buffers: %.1f MiB (%s)", self.nbytes() / 2**20, "pinned+shared" if pin else "shared")

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())

    def release(self) -> None:
        for ptr in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self.pinned, self.flats, self.views, self.layout = [], {}, {}, {}


def _check_cuda(status: Any, what: str) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise CheckpointError(f"{what} failed with CUDA error {code} (is /dev/shm large enough for the staging buffers?)")


def _layout_spec(layout: dict[str, tuple[torch.dtype, int, tuple[int, ...]]]) -> list[tuple[str, str, int, list[int]]]:
    """A picklable description of the views: (key, dtype name, element offset, shape)."""
    return [(key, str(dtype), start, list(shape)) for key, (dtype, start, shape) in layout.items()]


def _views(flats: dict[str, torch.Tensor], spec: list[tuple[str, str, int, list[int]]]) -> dict[str, torch.Tensor]:
    views = {}
    for key, dtype_name, start, shape in spec:
        numel = 1
        for n in shape:
            numel *= n
        views[key] = flats[dtype_name][start : start + numel].view(shape)
    return views


# --------------------------------------------------------------------------------------------------------------
# The writer: runs in the NVRx background process (or inline for synchronous saves). Never raises: its outcome
# (size + sha256 of the file it wrote, or the error) goes back through the shared ``report`` buffer.


class _HashingWriter:
    """File wrapper for ``torch.save`` that hashes and counts the bytes as they are written (no second read)."""

    def __init__(self, f: BinaryIO, fault: str) -> None:
        self.f, self.fault, self.size, self.sha256 = f, fault, 0, hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        if self.fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.f.write(data)
        self.sha256.update(data)
        self.size += len(memoryview(data).cast("B"))
        if self.fault.startswith("slow_write:"):
            time.sleep(float(self.fault.split(":", 1)[1]))  # test hook: a writer caught mid-file
            self.fault = ""
        return n

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_torch_save(obj: Any, path: Path, fault: str = "") -> tuple[int, str]:
    """``torch.save`` to ``<path>.partial``, fsync, rename, fsync the directory; returns (bytes, sha256)."""
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f, fault)
        torch.save(obj, writer)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return writer.size, writer.sha256.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


_watchdog_started = False


def _exit_when_orphaned() -> None:
    """In the writer process: exit when the trainer that owns it dies (SIGKILL leaves no one to say DONE).

    The writer ignores SIGTERM/SIGINT: on preemption ft_launcher signals each worker's whole process group,
    and the trainer's final checkpoint needs this writer alive to finish. It is stopped by its owner (DONE, or
    SIGKILL) or by this watchdog when the owner is gone.
    """
    global _watchdog_started
    if _watchdog_started:
        return
    _watchdog_started = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # FT: preemption must not kill an in-flight save
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_ORPHAN_CHECK_S)
        os._exit(_EXIT_ORPHANED)

    threading.Thread(target=watch, name="ckpt-orphan-watchdog", daemon=True).start()


def write_shard(
    flats: dict[str, torch.Tensor],
    spec: list[tuple[str, str, int, list[int]]],
    payload: dict[str, Any],
    path: str,
    report: torch.Tensor,
    fault: str = "",
    background: bool = True,
) -> None:
    """Write one rank's shard file atomically; report ``{"ok", "bytes", "sha256", ...}`` or the error."""
    if background:
        _exit_when_orphaned()
    started = time.perf_counter()
    try:
        size, digest = _atomic_torch_save({**payload, "tensors": _views(flats, spec)}, Path(path), fault)
        result: dict[str, Any] = {"ok": True, "bytes": size, "sha256": digest}
    except Exception as exc:  # reported to every rank at commit; never kill the persistent writer
        result = {"ok": False, "errno": getattr(exc, "errno", None), "error": f"{type(exc).__name__}: {exc}"}
    result["write_s"] = round(time.perf_counter() - started, 4)
    _put_report(report, result)


def _put_report(report: torch.Tensor, result: dict[str, Any]) -> None:
    data = json.dumps(result).encode()[: REPORT_BYTES - 8]
    report[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    report[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)


def _take_report(report: torch.Tensor) -> dict[str, Any] | None:
    n = int.from_bytes(bytes(report[:8].tolist()), "little")
    if n == 0:
        return None
    result = json.loads(bytes(report[8 : 8 + n].tolist()))
    report[:8] = 0
    return result


# --------------------------------------------------------------------------------------------------------------
# Verification and reading (no process group needed).


def _read_manifest(step_dir: Path) -> tuple[dict[str, Any] | None, str, str]:
    """(manifest, reason slug, message); the manifest is None when missing or invalid."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None, "missing-manifest", f"{path} does not exist"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, "bad-manifest", f"{path} is not valid JSON: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return None, "bad-manifest", f"{path} is not a {FORMAT} v{VERSION} manifest"
    return manifest, "", ""


def _verify_shards(step_dir: Path, manifest: dict[str, Any], ranks: range | list[int], checksums: bool) -> list[tuple[str, str]]:
    """Problems ``(reason slug, message)`` with the listed shard files: missing, wrong size, wrong sha256."""
    problems = []
    shards = manifest["shards"]
    for i in ranks:
        if i >= len(shards):
            continue
        entry = shards[i]
        path = step_dir / entry["file"]
        if not path.is_file():
            problems.append(("missing-shard", f"{path} does not exist"))
        elif path.stat().st_size != entry["bytes"]:
            problems.append(("size-mismatch", f"{path} has {path.stat().st_size} bytes, manifest says {entry['bytes']}"))
        elif checksums and sha256_file(path) != entry["sha256"]:
            problems.append(("checksum-mismatch", f"{path} sha256 differs from the manifest"))
    return problems


def _load_file(path: Path) -> dict[str, Any]:
    """A shard file, memory-mapped (only the slices actually read are paged in); weights_only, always."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


class _Shards:
    """Lazily opened shard files of one committed checkpoint."""

    def __init__(self, step_dir: Path, manifest: dict[str, Any]) -> None:
        self.dir, self.manifest, self._open = step_dir, manifest, {}

    def file(self, rank: int) -> dict[str, Any]:
        if rank not in self._open:
            self._open[rank] = _load_file(self.dir / self.manifest["shards"][rank]["file"])
        return self._open[rank]

    def fill(self, key: str, dst: torch.Tensor, piece: Piece) -> None:
        """Copy the region ``piece`` of the global tensor ``key`` into ``dst`` from whichever files hold it."""
        meta = self.manifest["tensors"].get(key)
        if meta is None:
            raise CheckpointError(f"{self.dir}: has no tensor {key!r}; the model/optimizer differ from the checkpoint's")
        if tuple(meta["global_shape"]) != piece.global_shape:
            raise CheckpointError(
                f"{self.dir}: {key} has shape {tuple(meta['global_shape'])} in the checkpoint but "
                f"{piece.global_shape} in this model; use the model config the checkpoint was saved with"
            )
        sources = meta["pieces"] if meta["sharded"] else meta["pieces"][:1]
        covered, seen = 0, set()
        for src in sources:
            region = (tuple(src["offset"]), tuple(src["shape"]))
            if region in seen:  # a replicated copy (e.g. HSDP) of a region already read
                continue
            seen.add(region)
            covered += _copy_overlap(dst, piece.offset, self.file(src["rank"])["tensors"][key], *region)
        if covered != dst.numel():
            raise CheckpointError(f"{self.dir}: {key} covers {covered} of {dst.numel()} elements of this rank's shard")


def _copy_overlap(dst: torch.Tensor, dst_offset: tuple[int, ...], src: torch.Tensor, src_offset: tuple[int, ...], src_shape: tuple[int, ...]) -> int:
    """Copy the intersection of two boxes of the same global tensor; returns the elements copied."""
    dst_idx, src_idx, count = [], [], 1
    for d in range(dst.ndim):
        lo = max(dst_offset[d], src_offset[d])
        hi = min(dst_offset[d] + dst.shape[d], src_offset[d] + src_shape[d])
        if hi <= lo:
            return 0
        dst_idx.append(slice(lo - dst_offset[d], hi - dst_offset[d]))
        src_idx.append(slice(lo - src_offset[d], hi - src_offset[d]))
        count *= hi - lo
    with torch.no_grad():
        dst[tuple(dst_idx)].copy_(src[tuple(src_idx)])
    return count


def find_valid_checkpoint(directory: str | Path, step: int | None = None, checksums: bool = True) -> tuple[Path, dict[str, Any]]:
    """The newest (or the given) committed checkpoint whose manifest and shards verify; read-only (no renames).

    Invalid newer ones are skipped with a WARNING. Raises ``CheckpointError`` when there is none.
    """
    directory = Path(directory)
    steps = [step] if step is not None else committed_steps(directory)[::-1]
    for candidate in steps:
        step_dir = directory / step_dir_name(candidate)
        manifest, reason, message = _read_manifest(step_dir)
        problems = [(reason, message)] if manifest is None else _verify_shards(step_dir, manifest, range(len(manifest["shards"])), checksums)
        if not problems:
            return step_dir, manifest  # type: ignore[return-value]
        log.warning("checkpoint %s is invalid (%s): %s; skipping it", step_dir, problems[0][0], problems[0][1])
    raise CheckpointError(f"no valid checkpoint in {directory} (checked steps {steps}); see the warnings above")


def load_model_weights(directory: str | Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of the newest valid (or the given) checkpoint, written on any world size.

    One process, no process group needed (evaluation). Keys are the model's FQNs.
    """
    step_dir, manifest = find_valid_checkpoint(directory, step)
    shards = _Shards(step_dir, manifest)
    weights = {}
    for key, meta in manifest["tensors"].items():
        if not key.startswith(MODEL_PREFIX):
            continue
        full = torch.empty(meta["global_shape"], dtype=getattr(torch, meta["dtype"]))
        shards.fill(key, full, Piece(tuple(meta["global_shape"]), (0,) * full.ndim, tuple(full.shape), full.dtype, False))
        weights[key[len(MODEL_PREFIX) :]] = full
    return weights


# --------------------------------------------------------------------------------------------------------------


@dataclass
class InMemoryCheckpoint:
    """The last committed step as staged in host memory (this rank's shards); valid until the next save stages."""

    step: int
    rank: int
    world_size: int
    tensors: dict[str, torch.Tensor]
    payload: dict[str, Any]
    pieces: dict[str, Piece]


@dataclass
class _Pending:
    """A staged save that is not committed yet."""

    step: int
    tmp_dir: Path
    file: str
    pieces: dict[str, Piece]
    payload: dict[str, Any]
    submitted: bool = False
    report: dict[str, Any] | None = None
    cuda_event: Any = None


class CheckpointManager:
    """Saves and restores the training state; one per process, bound to each attempt's process group."""

    def __init__(
        self, cfg: CheckpointConfig, directory: str | Path, env: DistEnv, config_json: str,
        coordination_timeout_s: float = 30.0,
    ) -> None:
        """``coordination_timeout_s`` bounds every collective the manager runs on its own gloo group (GPU runs):
        gloo collectives cannot be aborted, so it must stay below the in-process layer's soft timeout, or a rank
        waiting here for a failed peer could not be restarted in-process."""
        self.cfg, self.dir, self.env, self.config_json = cfg, Path(directory), env, config_json
        self.coordination_timeout_s = coordination_timeout_s
        self._staging = _Staging()
        self._report = torch.zeros(REPORT_BYTES, dtype=torch.uint8).share_memory_()
        self._queue: AsyncCallsQueue | None = None
        self._pending: _Pending | None = None
        self._memory: InMemoryCheckpoint | None = None
        self._stream: Any = None
        self._bound = False
        self._closed = False
        self._group: Any = None
        self.rank, self.world_size = env.rank, env.world_size
        self.loaded_step: int | None = None
        self.last_committed: int | None = None
        self.blocking_s: list[float] = []
        """Seconds the training loop was blocked by each save (staging, plus the write for synchronous saves)."""
        atexit.register(self.close)

    # ---- per attempt ------------------------------------------------------------------------------------------
    def bind(self) -> None:
        """Per attempt, after ``init_process_group`` (collective). Takes the new process group and settles a save
        the previous attempt left in flight: committed when every rank's writer finished it, discarded otherwise."""
        # FT: in-process restarts re-run train() with a new process group; the writer and staging buffers live on.
        if self._closed:
            raise CheckpointError("CheckpointManager.bind() after close()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Its own gloo group (on CPU too, so the tests exercise the GPU path): commit polling never interleaves with
        # training collectives, and unbind() can close it without touching the training process group.
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.coordination_timeout_s))
        self._bound = True
        self._settle_leftover()

    def unbind(self) -> None:
        """End of an attempt, normal or failed. No collectives (the process group may be broken): an in-flight
        write keeps running and the next ``bind()`` decides about it."""
        # FT: runs in train()'s finally, also after a fault. Destroying this rank's coordination group closes its
        # sockets, so a peer blocked in one of the group's gloo collectives (they cannot be aborted) fails within a
        # second instead of waiting for the timeout, and its in-process restart can begin.
        self._bound = False
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):  # the process group may already be broken
                dist.destroy_process_group(group)

    def close(self) -> None:
        """Stop the background writer (idempotent; also registered with atexit). An uncommitted save is abandoned:
        its ``.tmp`` directory is removed by the next run."""
        if self._closed:
            return
        self._closed = True
        self._bound = False
        if self._pending is not None:
            log.warning("checkpoint step %d was not committed before close(); it is abandoned", self._pending.step)
            self._pending = None
        self._stop_writer(graceful=True)
        self._staging.release()
        self._memory = None

    # ---- the loop's interface -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], last_step: bool = False, force: bool = False) -> bool:
        """Called every step on every rank; saves when due (``interval``, ``last_step``) or ``force``d.

        ``force=True`` (preemption, SIGTERM) and ``last_step`` return only once the checkpoint is committed;
        otherwise an asynchronous save returns after staging. Returns True when a save of ``step`` was made.
        Raises ``CheckpointStorageError`` when a write failed (e.g. disk full), naming the directory.
        """
        self._require_bound()
        due = force or last_step or (self.cfg.interval > 0 and step % self.cfg.interval == 0)
        if self._pending is not None and self._pending.submitted:
            self._try_commit(blocking=due)  # one tiny collective per step while a write is in flight
        if not due:
            return False
        if self.last_committed == step or (self._pending is not None and self._pending.step == step):
            self._finish_pending()  # already saved (e.g. a forced save right after the regular one)
            return True
        self._finish_pending()  # the previous save must be committed before its staging buffers are reused
        started = time.perf_counter()
        sync = force or not self.cfg.async_save
        self._stage(step, state)
        if sync:
            self._submit(inline=True)
        elif self._pending is not None and self._pending.cuda_event is None:
            self._submit(inline=False)  # CPU: staged already; CUDA submits in wait_for_staging()
        if sync or last_step:
            self._finish_pending()
        self.blocking_s.append(time.perf_counter() - started)
        return True

    def wait_for_staging(self) -> None:
        """Called before ``optimizer.step()``: blocks until the device-to-host copy of a save has finished (CUDA),
        then hands the buffers to the writer. The write itself never blocks here."""
        if self._pending is None or self._pending.submitted:
            return
        started = time.perf_counter()
        self._pending.cuda_event.synchronize()
        self._submit(inline=False)
        if self.blocking_s:
            self.blocking_s[-1] += time.perf_counter() - started

    def latest_in_memory(self) -> InMemoryCheckpoint | None:
        """This rank's copy of the newest committed checkpoint in host memory, or None (not saved yet, or the
        buffers hold a save that is not committed)."""
        return self._memory

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Restore the newest valid checkpoint (collective); returns its step, or None when training starts fresh.

        Prefers the in-memory copy when every rank holds the newest committed step. Invalid checkpoints are moved
        aside as ``step-X.corrupt-<reason>`` with an ERROR log line and the previous one is tried. Raises
        ``CheckpointError`` when checkpoints exist but none is valid. Without one, ``init_from`` warm-starts.
        """
        self._require_bound()
        self._remove_incomplete()
        step = self._load_newest_valid(state) if self.cfg.resume else None
        if step is None and self.cfg.init_from:
            self._warm_start(state)
        self.loaded_step = step
        return step

    # ---- staging and writing --------------------------------------------------------------------------------
    def _stage(self, step: int, state: dict[str, Any]) -> None:
        live, optim_extra = _flatten(state)
        locals_, pieces = {}, {}
        for key, value in live.items():
            locals_[key], pieces[key] = _local(value)
        on_cuda = any(t.is_cuda for t in locals_.values())
        self._memory = None  # the buffers are about to hold a save that is not committed
        self._staging.ensure(pieces, pin=on_cuda)
        event = None
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for key, src in locals_.items():
                    self._staging.views[key].copy_(src.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        else:
            for key, src in locals_.items():
                self._staging.views[key].copy_(src.detach())  # also CPU-resident state (Adam step): a snapshot
        payload = {
            "format": FORMAT, "version": VERSION, "step": step, "rank": self.rank, "world_size": self.world_size,
            "rank_state": _rank_state(state), **optim_extra, "config_json": self.config_json,
        }
        tmp_dir = self.dir / (step_dir_name(step) + TMP_SUFFIX)
        tmp_dir.mkdir(parents=True, exist_ok=True)
        self._pending = _Pending(step, tmp_dir, shard_file_name(self.rank, self.world_size), pieces, payload, cuda_event=event)

    def _submit(self, inline: bool) -> None:
        pending = self._pending
        assert pending is not None
        if pending.cuda_event is not None:
            pending.cuda_event.synchronize()
        self._report[:8] = 0
        args = (self._staging.flats, _layout_spec(self._staging.layout), pending.payload,
                str(pending.tmp_dir / pending.file), self._report, _test_fault(pending.step))
        if inline:
            write_shard(*args, background=False)
        else:
            if self._queue is None:
                self._queue = AsyncCallsQueue(persistent=True)
            # no_dist everywhere: NVRx's own cross-rank checks all-reduce CUDA tensors; ours run at commit on gloo.
            self._queue.schedule_async_request(AsyncRequest(write_shard, args, []))
        pending.submitted = True

    def _local_done(self, blocking: bool) -> bool:
        """Whether this rank's writer finished the pending shard (its report is then in ``pending.report``)."""
        pending = self._pending
        assert pending is not None and pending.submitted
        while pending.report is None:
            if self._queue is not None and self._queue.get_num_unfinalized_calls():
                self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if self._queue is None or not self._queue.get_num_unfinalized_calls():
                pending.report = _take_report(self._report) or {"ok": False, "error": "the writer sent no report"}
                break
            if not self._writer_alive():
                code = self._queue.persistent_caller.process.exitcode  # type: ignore[union-attr]
                pending.report = {"ok": False, "error": f"the checkpoint writer process died (exit code {code})"}
                self._stop_writer(graceful=False)
                break
            if not blocking:
                return False
            time.sleep(_POLL_S)
        return True

    def _writer_alive(self) -> bool:
        caller = self._queue.persistent_caller if self._queue is not None else None
        return caller is not None and caller.process is not None and caller.process.is_alive()

    def _stop_writer(self, graceful: bool) -> None:
        if self._queue is None:
            return
        queue, self._queue = self._queue, None
        caller = queue.persistent_caller
        if caller is None or caller.process is None:
            return
        if graceful and caller.process.is_alive() and not queue.get_num_unfinalized_calls():
            caller.close()  # sends DONE and joins
            return
        caller.process.kill()  # it ignores SIGTERM (see _exit_when_orphaned)
        caller.process.join(timeout=10)
        caller.process = None  # NVRx's close()/__del__ would wait forever on a dead worker's queue

    # ---- commit (collective) --------------------------------------------------------------------------------
    def _try_commit(self, blocking: bool) -> None:
        """Commit the pending save once every rank's writer finished it. Ranks agree by polling (one tiny
        all-reduce per poll) rather than by blocking in a collective while a peer still writes: no collective
        here waits longer than a poll, so a short coordination timeout is safe."""
        while True:
            done = self._local_done(blocking=False)
            if self.world_size > 1:
                flag = torch.tensor([int(done)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
                done = bool(flag.item())
            if done or not blocking:
                break
            time.sleep(_COMMIT_POLL_S)
        if done:
            self._local_done(blocking=True)
            self._commit()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        if not self._pending.submitted:
            self._submit(inline=False)
        self._try_commit(blocking=True)

    def _commit(self) -> None:
        pending = self._pending
        assert pending is not None and pending.report is not None
        mine = {"rank": self.rank, "file": pending.file, "report": pending.report,
                "pieces": {k: [list(p.offset), list(p.shape)] for k, p in pending.pieces.items()}}
        everyone = self._all_gather((pending.step, mine))
        outcome: dict[str, Any] = {"ok": True}
        if self.rank == 0:
            outcome = self._commit_on_rank0(pending, [m for s, m in everyone if s == pending.step], len(everyone))
        outcome = self._broadcast(outcome)
        self._pending = None
        if not outcome["ok"]:
            raise CheckpointStorageError(outcome["message"])
        self.last_committed = pending.step
        self._memory = InMemoryCheckpoint(pending.step, self.rank, self.world_size, self._staging.views,
                                          pending.payload, pending.pieces)

    def _commit_on_rank0(self, pending: _Pending, reports: list[dict[str, Any]], world: int) -> dict[str, Any]:
        final = self.dir / step_dir_name(pending.step)
        failed = [r for r in reports if not r["report"]["ok"]]
        if len(reports) != world:
            failed.append({"rank": "?", "report": {"ok": False, "error": "ranks saved different steps"}})
        try:
            if not failed:
                manifest = self._manifest(pending, sorted(reports, key=lambda r: r["rank"]))
                _atomic_write_text(pending.tmp_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                if final.exists():  # the same step saved again (e.g. a run restarted with resume=false)
                    shutil.rmtree(final)
                os.rename(pending.tmp_dir, final)
                _fsync_dir(self.dir)
                log.info("checkpoint committed: %s (%d shards, %.1f MiB)", final, len(reports),
                         sum(r["report"]["bytes"] for r in reports) / 2**20)
                self._apply_retention()
                return {"ok": True}
        except OSError as exc:
            failed.append({"rank": 0, "report": {"ok": False, "errno": exc.errno, "error": f"manifest/commit: {exc}"}})
        shutil.rmtree(pending.tmp_dir, ignore_errors=True)  # a partial save: free the space it took
        first = failed[0]
        disk_full = any(f["report"].get("errno") in _DISK_FULL_ERRNOS for f in failed)
        what = "the disk is full (no space left on device)" if disk_full else "a write failed"
        keep = committed_steps(self.dir)
        message = (
            f"checkpoint step {pending.step} could not be written to {self.dir}: {what} - rank {first['rank']}: "
            f"{first['report'].get('error')}. The partial save was removed; the committed checkpoints "
            f"{[step_dir_name(s) for s in keep]} are intact. "
            + ("Free space there or set checkpoint.dir to a larger volume." if disk_full else "Check the storage.")
        )
        log.error(message)
        return {"ok": False, "message": message}

    def _manifest(self, pending: _Pending, reports: list[dict[str, Any]]) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for key, piece in pending.pieces.items():
            tensors[key] = {
                "global_shape": list(piece.global_shape), "dtype": str(piece.dtype).removeprefix("torch."),
                "sharded": piece.sharded,
                "pieces": [{"rank": r["rank"], "offset": r["pieces"][key][0], "shape": r["pieces"][key][1]} for r in reports],
            }
        return {
            "format": FORMAT, "version": VERSION, "step": pending.step, "world_size": len(reports),
            "created_unix": round(time.time(), 3), "config": json.loads(self.config_json),
            "dataloader": pending.payload["rank_state"]["dataloader"],
            "shards": [{"rank": r["rank"], "file": r["file"], "bytes": r["report"]["bytes"],
                        "sha256": r["report"]["sha256"]} for r in reports],
            "tensors": tensors,
        }

    def _apply_retention(self) -> None:
        steps = committed_steps(self.dir)
        for step in steps[: max(0, len(steps) - self.cfg.keep)]:
            if step == self.loaded_step:
                continue  # never the checkpoint this attempt was loaded from
            shutil.rmtree(self.dir / step_dir_name(step), ignore_errors=True)
            log.info("retention (keep=%d): removed %s", self.cfg.keep, self.dir / step_dir_name(step))

    def _settle_leftover(self) -> None:
        """At bind: commit the previous attempt's in-flight save if every rank finished the same step, else drop it."""
        pending = self._pending
        mine = None
        if pending is not None and pending.submitted and self._local_done(blocking=True):
            mine = (pending.step, bool(pending.report and pending.report["ok"]), self.world_size)
        everyone = self._all_gather(mine)
        if mine is not None and all(m == mine for m in everyone) and mine[1]:
            log.info("committing step %d, written before the restart", mine[0])
            self._commit()
            return
        if any(everyone) and self.rank == 0:
            for step in {m[0] for m in everyone if m}:
                tmp = self.dir / (step_dir_name(step) + TMP_SUFFIX)
                log.warning("discarding %s: not every rank finished it before the restart", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        self._pending = None

    # ---- loading (collective) ---------------------------------------------------------------------------------
    def _remove_incomplete(self) -> None:
        if self.rank == 0 and self.dir.is_dir() and self._pending is None:
            for tmp in self.dir.glob(f"step-*{TMP_SUFFIX}"):
                log.warning("removing %s: a save that never committed (the process stopped mid-write)", tmp)
                shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()

    def _load_newest_valid(self, state: dict[str, Any]) -> int | None:
        tried: list[str] = []
        while True:
            candidates = committed_steps(self.dir) if self.rank == 0 else []
            step = self._broadcast(candidates[-1] if candidates else None)
            if step is None:
                break
            if self._memory_matches(step):
                self._restore_from_memory(state)
                log.info("restored step %d from the in-memory copy (no disk read)", step)
                return step
            step_dir = self.dir / step_dir_name(step)
            manifest, reason, message = _read_manifest(step_dir)
            problems = [(reason, message)] if manifest is None else _verify_shards(
                step_dir, manifest, range(self.rank, len(manifest["shards"]), self.world_size), self.cfg.verify_checksums)
            problems = [p for per_rank in self._all_gather(problems) for p in per_rank]
            if not problems:
                self._restore_from_disk(state, step_dir, manifest)  # type: ignore[arg-type]
                log.info("restored step %d from %s", step, step_dir)
                return step
            tried.append(f"{step_dir.name} ({problems[0][0]})")
            if self.rank == 0:
                self._quarantine(step_dir, problems)
            self._barrier()
        if tried:
            raise CheckpointError(
                f"no valid checkpoint in {self.dir}: {', '.join(tried)} failed verification and were moved aside "
                "as *.corrupt-*; restore a good checkpoint there, or set checkpoint.resume=false to start over"
            )
        return None

    def _quarantine(self, step_dir: Path, problems: list[tuple[str, str]]) -> None:
        reason = problems[0][0]
        target = step_dir.with_name(f"{step_dir.name}{CORRUPT_INFIX}{reason}")
        if target.exists():
            target = target.with_name(f"{target.name}-{int(time.time())}")
        os.rename(step_dir, target)
        log.error(
            "CHECKPOINT INVALID: %s (%s: %s); moved to %s for inspection, falling back to the previous checkpoint",
            step_dir, reason, "; ".join(m for _, m in problems[:3]), target,
        )

    def _memory_matches(self, step: int) -> bool:
        mem = self._memory
        mine = mem is not None and mem.step == step and mem.rank == self.rank and mem.world_size == self.world_size
        return all(self._all_gather(mine))

    def _restore_from_memory(self, state: dict[str, Any]) -> None:
        mem = self._memory
        assert mem is not None
        live, _ = _flatten(state)
        for key, value in live.items():
            dst, piece = _local(value)
            if key not in mem.tensors or mem.pieces[key] != piece:
                raise CheckpointError(f"in-memory checkpoint has no matching {key}; the model changed")
            with torch.no_grad():
                dst.copy_(mem.tensors[key])
        self._apply(state, live, mem.payload)

    def _restore_from_disk(self, state: dict[str, Any], step_dir: Path, manifest: dict[str, Any]) -> None:
        shards = _Shards(step_dir, manifest)
        live, _ = _flatten(state)
        for key, value in live.items():
            dst, piece = _local(value)
            shards.fill(key, dst, piece)
        source_rank = self.rank if self.rank < manifest["world_size"] else self.rank % manifest["world_size"]
        payload = shards.file(source_rank)
        if manifest["world_size"] != self.world_size:
            log.warning("resharding checkpoint of %d ranks onto %d: per-rank RNG streams are taken from rank %d",
                        manifest["world_size"], self.world_size, source_rank)
        self._apply(state, live, payload, restore_ft=source_rank == self.rank)

    def _apply(self, state: dict[str, Any], live: dict[str, torch.Tensor], payload: dict[str, Any], restore_ft: bool = True) -> None:
        """Load the filled live tensors back through the state-dict API, then the non-tensor state."""
        model_sd = {k[len(MODEL_PREFIX) :]: v for k, v in live.items() if k.startswith(MODEL_PREFIX)}
        _, optim_sd = get_state_dict(state["model"], state["optimizer"])
        for key, value in live.items():
            if key.startswith(OPTIM_PREFIX):
                fqn, name = key[len(OPTIM_PREFIX) :].rsplit("/", 1)
                optim_sd["state"][fqn][name] = value
        for key, value in payload["optim_scalars"].items():
            fqn, name = key[len(OPTIM_PREFIX) :].rsplit("/", 1)
            optim_sd["state"][fqn][name] = value
        for group, saved in zip(optim_sd["param_groups"], payload["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        set_state_dict(state["model"], state["optimizer"], model_state_dict=model_sd, optim_state_dict=optim_sd)
        rank_state = payload["rank_state"]
        state["progress"].load_state_dict(rank_state["progress"])
        state["dataloader"].load_state_dict(rank_state["dataloader"])
        if restore_ft and state.get("ft") is not None and "ft" in rank_state:
            state["ft"].load_state_dict(rank_state["ft"])  # FT: learned heartbeat timeouts

    def _warm_start(self, state: dict[str, Any]) -> None:
        source = Path(self.cfg.init_from)
        step_dir, manifest = find_valid_checkpoint(source, checksums=self.cfg.verify_checksums)
        shards = _Shards(step_dir, manifest)
        live, _ = _flatten(state, model_only=True)
        for key, value in live.items():
            dst, piece = _local(value)
            shards.fill(key, dst, piece)
        set_model_state_dict(state["model"], {k[len(MODEL_PREFIX) :]: v for k, v in live.items()})
        log.info("warm start: model weights from %s (optimizer, step and data position start fresh)", step_dir)

    # ---- collectives on the bound group -----------------------------------------------------------------------
    def _require_bound(self) -> None:
        if not self._bound:
            raise CheckpointError("CheckpointManager is not bound to a process group: call bind() after init_process_group")

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self._group)
