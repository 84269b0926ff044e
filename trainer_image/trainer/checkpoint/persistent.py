"""The persistent tier (``checkpoint.dir``): writing a snapshot slot there and reading it back.

Writing: each rank's background writer (``writer``) writes its shard from the slot; a write in flight is polled
with one tiny collective per step, so no rank ever waits in a collective for a slow disk; once every rank's
writer finished, rank 0 writes the manifest and renames the step's directory into place (``layout``'s commit
protocol), then applies retention. A blocking wait for a write keeps the loop's liveness signals going for as
long as the write may take on storage of ``checkpoint.min_write_mbps``.

Reading: the newest committed checkpoint whose files verify (checked while read); an invalid one is moved aside
as ``step-X.corrupt-<reason>`` and the previous one is tried. ``init_from`` warm-starts the model weights.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from trainer.checkpoint import storage
from trainer.checkpoint.coordination import Coordination
from trainer.checkpoint.errors import CheckpointError, CheckpointStorageError, is_disk_full
from trainer.checkpoint.layout import (
    CORRUPT_INFIX, FORMAT, MANIFEST, MODEL_PREFIX, TMP_SUFFIX, VERSION, Shards, committed_steps,
    find_valid_checkpoint, probe_loadable, read_manifest, shard_file_name, step_dir_name, verify_shards,
)
from trainer.checkpoint.slots import Slot
from trainer.checkpoint.state import apply, flatten, local_piece, local_tensors, numel, predicted_bytes
from trainer.checkpoint.writer import Writer, atomic_write_text, fsync_dir, test_fault
from trainer.config import CheckpointConfig

log = logging.getLogger(__name__)

_COMMIT_POLL_S = 0.05  # a blocking commit polls the ranks' writers this often
KEEPALIVE_S = 1.0  # while a blocking commit waits on the disk, the loop's liveness signals go out this often
_WRITE_GRACE_S = 30.0  # ... for this long plus the shard's bytes at checkpoint.min_write_mbps


@dataclass
class _Persist:
    """A snapshot being written to the persistent tier, not committed yet."""

    step: int
    slot: Slot
    tmp_dir: Path
    file: str
    submitted: bool = False
    report: dict[str, Any] | None = None
    abandoned: bool = False
    """Left by an attempt whose ranks did not all hold it: its write finishes in the background, unused."""
    retried: bool = False
    keepalive_until: float | None = None
    """Set when a blocking wait for this write begins: until when the loop's liveness signals go on (monotonic)."""
    alive_at: float = 0.0
    """When they last went out (or the budget ran out: then it is past ``keepalive_until``)."""
    started_at: float = field(default_factory=time.monotonic)
    """When its snapshot was taken (monotonic)."""


class PersistentTier:
    """This rank's side of ``checkpoint.dir``: at most one write in flight (``inflight``), its commit, and loading."""

    def __init__(self, cfg: CheckpointConfig, directory: Path, config_json: str, coord: Coordination,
                 writer: Writer) -> None:
        self.cfg, self.dir, self.config_json, self.coord, self.writer = cfg, directory, config_json, coord, writer
        self.inflight: _Persist | None = None
        self.save_bytes = 0
        """One persistent checkpoint's bytes, summed over ranks (``estimate_save_bytes``)."""
        self.bytes_read = 0
        """Bytes of ``checkpoint.dir`` the last ``read`` read on this rank (its manifest and the shards it verified)."""
        self.last_committed: int | None = None
        self.last_committed_at: float | None = None
        """When the newest committed checkpoint's snapshot was taken (monotonic; this process only)."""
        self.loaded_step: int | None = None
        """The checkpoint this attempt was loaded from: retention never removes it."""
        self.keepalive: Callable[[], None] = lambda: None
        """The loop's liveness signals, sent while a blocking wait for a write goes on (see ``CheckpointManager``)."""

    @property
    def rank(self) -> int:
        return self.coord.rank

    @property
    def world_size(self) -> int:
        return self.coord.world_size

    # ---- per attempt ------------------------------------------------------------------------------------------
    def rebind(self) -> None:
        """A new attempt (collective): a write the previous one left in flight is kept when every rank has it, else
        abandoned (it finishes in the background and is discarded). Never waits for it."""
        persist = self.inflight
        mine = (persist.step, persist.submitted) if persist is not None and not persist.abandoned else None
        if mine is not None and any(other != mine for other in self.coord.all_gather(mine)):
            log.info("abandoning the write of step %d: not every rank had it in flight", mine[0])
            persist.abandoned = True  # type: ignore[union-attr]
            if not persist.submitted:  # type: ignore[union-attr]
                persist.slot.locked, self.inflight = False, None  # type: ignore[union-attr]
        elif mine is None:
            self.coord.all_gather(None)

    # ---- writing ----------------------------------------------------------------------------------------------
    def start(self, slot: Slot, step: int) -> None:
        tmp_dir = self.dir / (step_dir_name(step) + TMP_SUFFIX)
        tmp_dir.mkdir(parents=True, exist_ok=True)
        self.inflight = _Persist(step, slot, tmp_dir, shard_file_name(self.rank, self.world_size))
        slot.locked = True

    def submit(self, persist: _Persist, inline: bool) -> None:
        slot = persist.slot
        assert slot.buffer is not None
        persist.submitted = True
        if self.rank == 0:
            problem = storage.make_room(self.dir, self.save_bytes)  # FT: retention frees space before a save
            if problem:
                persist.report = {"ok": False, "errno": errno.ENOSPC, "error": problem}
                return
        self.writer.submit(slot.data_path, slot.buffer.numel(), slot.layout, slot.payload,
                           persist.tmp_dir / persist.file, test_fault(persist.step), inline=inline)

    def _local_done(self, blocking: bool) -> bool:
        persist = self.inflight
        assert persist is not None
        if persist.report is None and persist.submitted:
            persist.report = self.writer.poll(blocking)
            if persist.report is not None and persist.report.get("writer_died") and not persist.retried \
                    and not persist.abandoned:
                # FT: the writer process was killed (OOM killer, a SIGTERM to the process group while it was
                # starting up): not a storage error. Write this shard once more, here, synchronously.
                log.warning("%s; writing step %d's shard again in this process", persist.report["error"], persist.step)
                persist.retried, persist.report = True, None
                slot = persist.slot
                assert slot.buffer is not None
                self.writer.submit(slot.data_path, slot.buffer.numel(), slot.layout, slot.payload,
                                   persist.tmp_dir / persist.file, "", inline=True)
                persist.report = self.writer.poll(blocking=True)
        return persist.report is not None

    def cancel(self, superseded_by: int) -> None:
        """Drop the write in flight, this rank's part (every rank does, at the same agreed save): its writer stops
        between chunks and removes its partial shard; the step's ``.tmp`` directory goes with the next commit's
        retention (every rank's writer has stopped by then). The final save does this rather than wait for an
        older state and then write the newest: one state written, not two."""
        persist = self.inflight
        if persist is None:
            return
        if persist.submitted and persist.report is None:
            self.writer.cancel()
            # A writer stops between chunks, but one blocked in a write or fsync on a slow disk stops only when
            # that returns: the liveness signals go on meanwhile (the final save of a preemption waits here).
            while (report := self.writer.poll(blocking=False)) is None:
                self._keep_alive_while_written(persist)
                time.sleep(_COMMIT_POLL_S)
            persist.report = report
        log.info("the write of step %d is cancelled: the final checkpoint of step %d supersedes it", persist.step,
                 superseded_by)
        persist.slot.locked = False
        self.inflight = None

    def lag(self, step: int) -> tuple[int, float] | None:
        """(steps, seconds) from the newest committed checkpoint's snapshot to ``step`` (None: none committed)."""
        if self.last_committed is None or self.last_committed_at is None:
            return None
        return step - self.last_committed, time.monotonic() - self.last_committed_at

    def writing(self) -> tuple[int, float] | None:
        """(step, seconds running) of the write in flight, if any."""
        persist = self.inflight
        return None if persist is None else (persist.step, time.monotonic() - persist.started_at)

    def poll(self, blocking: bool) -> int | None:
        """Commit the write in flight once every rank's writer finished it; returns the step committed, if one was.
        Ranks agree by polling (one tiny all-reduce per poll) rather than by blocking in a collective while a peer
        still writes."""
        persist = self.inflight
        assert persist is not None
        if persist.abandoned:  # only this rank's writer is waited for, never a collective
            if self._local_done(blocking):
                persist.slot.locked = False
                self.inflight = None
            return None
        while True:
            done = persist.submitted and self._local_done(blocking=False)
            done = self.coord.all_reduce([float(done)], dist.ReduceOp.MIN)[0] > 0
            if done or not blocking:
                break
            self._keep_alive_while_written(persist)
            time.sleep(_COMMIT_POLL_S)
        if not done:
            return None
        self._commit()
        return persist.step

    def _keep_alive_while_written(self, persist: _Persist) -> None:
        """FT: heartbeats stop while the loop waits on the disk, and a write's progress cannot be seen (the page
        cache takes the bytes at once, fsync waits). Send them for as long as a write of this shard may take on
        storage of ``checkpoint.min_write_mbps``; after that the write is taken for a hung disk."""
        now = time.monotonic()
        if persist.keepalive_until is None:
            assert persist.slot.buffer is not None
            persist.keepalive_until = now + _WRITE_GRACE_S + persist.slot.buffer.nbytes / (self.cfg.min_write_mbps * 1e6)
        if now <= persist.keepalive_until:
            if now - persist.alive_at >= KEEPALIVE_S:
                persist.alive_at = now
                self.keepalive()
        elif persist.alive_at <= persist.keepalive_until:  # the budget just ran out: say so once
            persist.alive_at = now
            log.warning("step %d's write is taking longer than its shard at checkpoint.min_write_mbps=%g allows: "
                        "the liveness signals stop (the recovery layers restart a rank stuck on a hung disk)",
                        persist.step, self.cfg.min_write_mbps)

    def _commit(self) -> None:
        persist = self.inflight
        assert persist is not None and persist.report is not None
        mine = {"rank": self.rank, "file": persist.file, "report": persist.report,
                "pieces": {k: [list(p.offset), list(p.shape)] for k, p in persist.slot.pieces.items()}}
        everyone = self.coord.all_gather((persist.step, mine))
        outcome: dict[str, Any] = {"ok": True}
        if self.rank == 0:
            outcome = self._commit_on_rank0(persist, [m for s, m in everyone if s == persist.step], len(everyone))
        outcome = self.coord.broadcast(outcome)
        persist.slot.locked = False
        self.inflight = None
        if not outcome["ok"]:
            raise CheckpointStorageError(outcome["message"])
        self.last_committed, self.last_committed_at = persist.step, persist.started_at

    def _commit_on_rank0(self, persist: _Persist, reports: list[dict[str, Any]], world: int) -> dict[str, Any]:
        final = self.dir / step_dir_name(persist.step)
        failed = [r for r in reports if not r["report"]["ok"]]
        if len(reports) != world:
            failed.append({"rank": "?", "report": {"ok": False, "error": "ranks saved different steps"}})
        try:
            if not failed:
                manifest = self._manifest(persist, sorted(reports, key=lambda r: r["rank"]))
                atomic_write_text(persist.tmp_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                if final.exists():  # the same step saved again (e.g. a run restarted with resume=false)
                    shutil.rmtree(final)
                os.rename(persist.tmp_dir, final)
                fsync_dir(self.dir)
                log.info("checkpoint committed: %s (%d shards, %.1f MiB)", final, len(reports),
                         sum(r["report"]["bytes"] for r in reports) / 2**20)
                self._apply_retention(persist.step)
                return {"ok": True}
        except OSError as exc:
            failed.append({"rank": 0, "report": {"ok": False, "errno": exc.errno, "error": f"manifest/commit: {exc}"}})
        shutil.rmtree(persist.tmp_dir, ignore_errors=True)  # a partial save: free the space it took
        first = failed[0]
        full = any(is_disk_full(errno_value=f["report"].get("errno"), message=str(f["report"].get("error")))
                   for f in failed)
        keep = [step_dir_name(s) for s in committed_steps(self.dir)]
        if full:
            message = (storage.disk_full_message(self.dir, int(self.save_bytes * storage.SIZE_MARGIN))
                       + f"; step {persist.step} was not saved, the committed checkpoints {keep} are intact")
        else:
            message = (f"checkpoint step {persist.step} could not be written to {self.dir}: rank {first['rank']}: "
                       f"{first['report'].get('error')}. The partial save was removed; the committed checkpoints "
                       f"{keep} are intact. Check the storage.")
        log.error(message)
        return {"ok": False, "message": message}

    def _manifest(self, persist: _Persist, reports: list[dict[str, Any]]) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for key, piece in persist.slot.pieces.items():
            tensors[key] = {
                "global_shape": list(piece.global_shape), "dtype": str(piece.dtype).removeprefix("torch."),
                "sharded": piece.sharded,
                "pieces": [{"rank": r["rank"], "offset": r["pieces"][key][0], "shape": r["pieces"][key][1]} for r in reports],
            }
        return {
            "format": FORMAT, "version": VERSION, "step": persist.step, "world_size": len(reports),
            "created_unix": round(time.time(), 3), "config": json.loads(self.config_json),
            "dataloader": persist.slot.payload["rank_state"]["dataloader"],
            "shards": [{"rank": r["rank"], "file": r["file"], "bytes": r["report"]["bytes"],
                        "chunk_bytes": r["report"]["chunk_bytes"], "chunk_sha256": r["report"]["chunk_sha256"]}
                       for r in reports],
            "tensors": tensors,
        }

    def _apply_retention(self, committed: int) -> None:
        steps = committed_steps(self.dir)
        for step in steps[: max(0, len(steps) - self.cfg.keep)]:
            if step == self.loaded_step:
                continue  # never the checkpoint this attempt was loaded from
            storage.remove_in_background(self.dir / step_dir_name(step))  # FT: no rank waits for the delete
            log.info("retention (keep=%d): removed %s", self.cfg.keep, self.dir / step_dir_name(step))
        for tmp in self.dir.glob(f"step-*{TMP_SUFFIX}"):  # abandoned writes, finished by every rank by now
            if tmp.name[5 : 5 + 8].isdigit() and int(tmp.name[5 : 5 + 8]) < committed:
                storage.remove_in_background(tmp)

    def estimate_save_bytes(self, state: dict[str, Any]) -> int:
        """The bytes of one persistent checkpoint, summed over ranks (exact once the optimizer has state)."""
        if state["optimizer"].state:
            mine = sum(p.dtype.itemsize * numel(p.shape) for p in local_tensors(state)[1].values())
        else:
            mine = predicted_bytes([local_piece(v)[1] for v in flatten(state, model_only=True)[0].values()], 1)
        return int(sum(self.coord.all_gather(mine)))

    # ---- loading (collective) ---------------------------------------------------------------------------------
    def remove_incomplete(self) -> None:
        if self.rank == 0 and self.dir.is_dir():
            keep = self.inflight.tmp_dir if self.inflight is not None else None
            for tmp in self.dir.glob(f"step-*{TMP_SUFFIX}"):
                if tmp != keep:  # FT: in the background: a restarted worker's restore does not wait for it
                    log.warning("removing %s: a save that never committed (the process stopped mid-write)", tmp)
                    storage.remove_in_background(tmp)
            storage.remove_leftovers(self.dir)
        self.coord.barrier()

    def read(self, state: dict[str, Any], step: int) -> list[tuple[str, str]]:
        """Restore ``step`` from disk into this rank's ``state``, its files verified while read (not collective: the
        ranks that restore from their own snapshots do not call it, ``restore``). Returns the problems found, each
        ``(reason, message)``; none when it was restored."""
        step_dir = self.dir / step_dir_name(step)
        started = time.perf_counter()
        manifest_file = step_dir / "manifest.json"
        self.bytes_read = manifest_file.stat().st_size if manifest_file.is_file() else 0
        manifest, reason, message = read_manifest(step_dir)
        problems = [(reason, message)] if manifest is None else self._check_files(step_dir, manifest, state)
        if not problems:
            self._restore_from_disk(state, step_dir, manifest)  # type: ignore[arg-type]
            log.info("restored step %d from %s (verified while read: %.2f s)", step, step_dir,
                     time.perf_counter() - started)
        return problems

    def quarantine(self, step: int, problems: list[tuple[str, str]]) -> None:
        """Move an invalid checkpoint aside as ``step-X.corrupt-<reason>`` (rank 0), logged loudly."""
        step_dir = self.dir / step_dir_name(step)
        reason = problems[0][0]
        target = step_dir.with_name(f"{step_dir.name}{CORRUPT_INFIX}{reason}")
        if target.exists():
            target = target.with_name(f"{target.name}-{int(time.time())}")
        os.rename(step_dir, target)
        log.error(
            "CHECKPOINT INVALID: %s (%s: %s); moved to %s for inspection, falling back to the previous checkpoint",
            step_dir, reason, "; ".join(m for _, m in problems[:3]), target,
        )

    def _check_files(self, step_dir: Path, manifest: dict[str, Any], state: dict[str, Any]) -> list[tuple[str, str]]:
        """Verify the files this rank will read (and its share of the rest): one disk pass, the load that follows
        reads them from the page cache. Then open them weights-only."""
        shards = Shards(step_dir, manifest)
        live, _ = flatten(state)
        needed: set[int] = set(range(self.rank, len(manifest["shards"]), self.world_size))
        try:
            for key, value in live.items():
                needed.update(shards.sources(key, local_piece(value)[1]))
        except CheckpointError as exc:
            return [("mismatch", str(exc))]
        ranks = sorted(needed)
        self.bytes_read += sum(int(s.get("bytes", 0)) for s in manifest["shards"] if s.get("rank") in needed)
        return verify_shards(step_dir, manifest, ranks, self.cfg.verify_checksums) or probe_loadable(step_dir, manifest, ranks)

    def _restore_from_disk(self, state: dict[str, Any], step_dir: Path, manifest: dict[str, Any]) -> None:
        shards = Shards(step_dir, manifest)
        live, _ = flatten(state)
        for key, value in live.items():
            dst, piece = local_piece(value)
            shards.fill(key, dst, piece)
        source_rank = self.rank if self.rank < manifest["world_size"] else self.rank % manifest["world_size"]
        payload = shards.file(source_rank)
        if manifest["world_size"] != self.world_size:
            log.warning("resharding checkpoint of %d ranks onto %d: per-rank RNG streams are taken from rank %d",
                        manifest["world_size"], self.world_size, source_rank)
        apply(state, live, payload, restore_ft=source_rank == self.rank)

    def warm_start(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        step_dir, manifest = find_valid_checkpoint(Path(self.cfg.init_from), checksums=self.cfg.verify_checksums)
        shards = Shards(step_dir, manifest)
        live, _ = flatten(state, model_only=True)
        for key, value in live.items():
            dst, piece = local_piece(value)
            shards.fill(key, dst, piece)
        set_model_state_dict(state["model"], {k[len(MODEL_PREFIX) :]: v for k, v in live.items()})
        log.info("warm start: model weights from %s (optimizer, step and data position start fresh)", step_dir)
