"""The checkpoint manager: composes the three tiers. One per process; each attempt of ``train()`` brackets its use
with ``bind()`` (after the new process group exists) and ``unbind()``.

The loop calls ``save(step, state)`` every step; the manager decides when a memory checkpoint is due
(``checkpoint.interval``, or ``"auto"``: Young/Daly). A memory checkpoint stages this rank's local shards into a
snapshot slot (``slots``): the only part that blocks the loop (on CUDA the copy overlaps the next forward and
backward until ``wait_for_staging()``). Every ``persist_every``-th one is also written to ``checkpoint.dir`` by the
background writer (``writer``) and committed with the atomic manifest (``layout``); a write in flight is polled
with one tiny collective per step, so no rank ever waits in a collective for a slow disk.

``load_latest`` restores from the nearest tier that every rank holds: memory (an in-process restart: no file is
read), node-local (a worker respawned on the same node), then the persistent tier (verified while it is read).
Decisions that must match across ranks (stage or skip, persist or not, the automatic interval) are agreed with
one small all-reduce at each due step, on the manager's own gloo group.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer.checkpoint import storage
from trainer.checkpoint.errors import CheckpointError, CheckpointStorageError, is_disk_full
from trainer.checkpoint.layout import (
    CORRUPT_INFIX, FORMAT, MANIFEST, MODEL_PREFIX, TMP_SUFFIX, VERSION, Piece, Shards, committed_steps,
    find_valid_checkpoint, probe_loadable, read_manifest, shard_file_name, step_dir_name, verify_shards,
)
from trainer.checkpoint.policy import IntervalPolicy
from trainer.checkpoint.slots import SnapshotStore, Slot, job_key, snapshot_dir
from trainer.checkpoint.state import apply, flatten, local_piece, local_tensors, rank_state
from trainer.checkpoint.writer import Writer, atomic_write_text, fsync_dir, test_fault
from trainer.config import CheckpointConfig
from trainer.parallel import DistEnv

log = logging.getLogger(__name__)

_COMMIT_POLL_S = 0.05  # a blocking commit polls the ranks' writers this often
_KEEPALIVE_S = 1.0  # while a blocking commit waits on the disk, the loop's liveness signals go out this often
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


class CheckpointManager:
    """Saves and restores the training state through the memory, node-local and persistent tiers."""

    def __init__(
        self, cfg: CheckpointConfig, directory: str | Path, env: DistEnv, config_json: str,
        coordination_timeout_s: float = 30.0,
    ) -> None:
        """``coordination_timeout_s`` bounds every collective the manager runs on its own gloo group (GPU runs):
        gloo collectives cannot be aborted, so it must stay below the in-process layer's soft timeout, or a rank
        waiting here for a failed peer could not be restarted in-process."""
        self.cfg, self.dir, self.env, self.config_json = cfg, Path(directory), env, config_json
        self.coordination_timeout_s = coordination_timeout_s
        storage.check_directory(self.dir, env.rank)  # FT: a bad checkpoint.dir is exit 4 at start, not at the first save
        self.snapshots = SnapshotStore(snapshot_dir(cfg.node_local_dir, self.dir), env.rank, cfg.memory_slots,
                                       job_key(self.dir), config_json, cfg.node_local)
        self.writer = Writer()
        self.policy = IntervalPolicy(cfg.interval, cfg.mtbf_s)
        self._persist: _Persist | None = None
        self._stream: Any = None
        self._bound = False
        self._closed = False
        self._group: Any = None
        self._memory_saves = 0
        self._save_bytes = 0
        self.rank, self.world_size = env.rank, env.world_size
        self.loaded_step: int | None = None
        self.restored_from: str | None = None
        """The tier the last ``load_latest`` restored from: memory, node-local, disk, or None."""
        self.last_committed: int | None = None
        self.blocking_s: list[float] = []
        """Seconds the training loop was blocked by each memory checkpoint (staging, plus the write when synchronous)."""
        self.event_sink: Callable[..., None] = lambda event, **fields: None
        """Where decisions worth recording go (the recovery ledger): ``event_sink(event, **fields)``."""
        self.keepalive: Callable[[], None] = lambda: None
        """The loop's liveness signals (in-job heartbeat, in-process progress ping), sent about once a second while
        a blocking save (the final one, a preemption's) waits on the disk, so a slow disk is not taken for a hung
        rank; for at most ``checkpoint.min_write_mbps``'s budget, after which the monitors may end the rank."""
        atexit.register(self.close)

    # ---- per attempt ------------------------------------------------------------------------------------------
    def bind(self) -> None:
        """Per attempt, after ``init_process_group`` (collective). Takes the new process group. A persistent write
        the previous attempt left in flight is never waited for: it is kept when every rank has it, else abandoned
        (it finishes in the background and is discarded)."""
        # FT: in-process restarts re-run train() with a new process group; writer and snapshot slots live on.
        if self._closed:
            raise CheckpointError("CheckpointManager.bind() after close()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.snapshots.rebind(self.rank, self.world_size)
        # Its own gloo group (on CPU too, so the tests exercise the GPU path): polling never interleaves with
        # training collectives, and unbind() can close it without touching the training process group.
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.coordination_timeout_s))
        self._bound = True
        staged = self.snapshots.staged()
        if staged is not None:  # the attempt ended while copying: that slot is not a snapshot (fall back)
            if staged.event is not None:
                staged.event.synchronize()
            staged.staging, staged.event = None, None
            if self._persist is not None and self._persist.slot is staged:
                staged.locked, self._persist = False, None
        persist = self._persist
        mine = (persist.step, persist.submitted) if persist is not None and not persist.abandoned else None
        if mine is not None and any(other != mine for other in self._all_gather(mine)):
            log.info("abandoning the write of step %d: not every rank had it in flight", mine[0])
            persist.abandoned = True  # type: ignore[union-attr]
            if not persist.submitted:  # type: ignore[union-attr]
                persist.slot.locked, self._persist = False, None  # type: ignore[union-attr]
        elif mine is None:
            self._all_gather(None)

    def unbind(self) -> None:
        """End of an attempt, normal or failed. No collectives (the process group may be broken): a write in
        flight keeps running and the next ``bind()`` decides about it."""
        # FT: runs in train()'s finally, also after a fault. Destroying this rank's coordination group closes its
        # sockets, so a peer blocked in one of the group's gloo collectives (they cannot be aborted) fails within a
        # second instead of waiting for the timeout, and its in-process restart can begin.
        self._bound = False
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):  # the process group may already be broken
                dist.destroy_process_group(group)

    def close(self, job_over: bool = False) -> None:
        """End of the process (idempotent; also registered with atexit): stop the writer, unmap the slots. An
        uncommitted write is abandoned (its ``.tmp`` directory is removed by the next run). ``job_over`` (success,
        or a permanent error) also removes this rank's node-local snapshots; otherwise they stay for a respawned
        worker, and ``entrypoint.sh`` removes the job's snapshot directory when the job ends."""
        if self._closed:
            return
        self._closed = True
        self._bound = False
        if self._persist is not None and not self._persist.abandoned:
            log.warning("checkpoint step %d was not committed before close(); it is abandoned", self._persist.step)
        self._persist = None
        self.writer.stop(graceful=True)
        self.snapshots.close(remove=job_over)

    # ---- the loop's interface -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], last_step: bool = False, force: bool = False) -> bool:
        """Called every step on every rank; takes a memory checkpoint when due (``interval``, ``last_step``) or
        ``force``d, and persists every ``persist_every``-th one.

        ``force=True`` (preemption, SIGTERM) and ``last_step`` return only once the checkpoint is committed to
        disk; otherwise the call returns after staging. Returns True when a checkpoint of ``step`` was taken.
        Raises ``CheckpointStorageError`` when a write failed (e.g. disk full), naming the directory."""
        self._require_bound()
        self._after_first_step()
        self.policy.tick()
        if self._persist is not None:
            self._poll_persist(blocking=False)  # one tiny collective per step while a write is in flight
        final = force or last_step
        if not (final or self.policy.due(step)):
            return False
        started = time.perf_counter()
        newest = self.snapshots.newest()
        if newest is not None and newest.step == step:  # already taken (e.g. a forced save after the regular one)
            if final:
                self._persist_final(newest)
            return True
        if final:
            self._drain_persist()  # frees the slot it holds: the final save never skips
        free, idle, step_s, cost_s = self._agree(step)
        if not free:
            log.warning("memory checkpoint of step %d skipped: every snapshot slot is busy (a write in flight); "
                        "raise checkpoint.memory_slots to keep one per interval", step)
            return False
        slot = self.snapshots.choose()
        assert slot is not None
        self._stage(slot, step, state)
        self._memory_saves += 1
        every = self.cfg.persist_every
        if final or (idle and every > 0 and self._memory_saves % every == 0):
            self._start_persist(slot, step)
        if slot.event is None or final or not self.cfg.async_save:
            self._complete_staging()
        if final or not self.cfg.async_save:
            self._drain_persist()
        self.blocking_s.append(time.perf_counter() - started)
        interval = self.policy.snapshot_taken(step, step_s, cost_s)
        if interval is not None:
            self._record_interval(interval, step_s, cost_s)
        return True

    def _after_first_step(self) -> None:
        """What the first step after a (re)start must not wait for starts at its end (the first ``save`` call): the
        snapshot slots' reservation and, for background writes, the writer process."""
        # FT: page-locking the slots holds the CUDA driver for seconds: not during the restore and the first step
        self.snapshots.start_prepare()
        if self.cfg.async_save and self.cfg.persist_every > 0:
            self.writer.start()  # spawning it imports torch: seconds the first write would otherwise wait

    def wait_for_staging(self) -> None:
        """Called before ``optimizer.step()``: blocks until the device-to-host copy of a memory checkpoint has
        finished (CUDA), then hands the slot to the writer when it is to be persisted. Never waits for the disk."""
        slot = self.snapshots.staged()
        if slot is None:
            return
        started = time.perf_counter()
        self._complete_staging()
        if self.blocking_s:
            self.blocking_s[-1] += time.perf_counter() - started

    def latest_in_memory(self) -> Slot | None:
        """This rank's newest complete memory checkpoint, or None."""
        return self.snapshots.newest()

    def load_latest(self, state: dict[str, Any], while_copying: Callable[[], None] | None = None) -> int | None:
        """Restore the newest checkpoint every rank can load (collective); returns its step, or None when training
        starts fresh. Tiers, nearest first: memory, node-local, persistent. An invalid persistent checkpoint is
        moved aside as ``step-X.corrupt-<reason>`` with an ERROR line and the previous one is tried; a bad
        node-local snapshot is ignored with a WARNING. Raises ``CheckpointError`` when checkpoints exist but none
        is valid. Without one, ``init_from`` warm-starts. ``while_copying`` runs while a snapshot (memory or
        node-local tier) is copied in, before its non-tensor state (RNG, data position) is applied."""
        self._require_bound()
        self._remove_incomplete()
        self._save_bytes = self._estimate_save_bytes(state)
        problem = storage.room_problem(self.dir, self._save_bytes, self.cfg.keep) if self.rank == 0 else ""
        problem = self._broadcast(problem)
        if problem:  # FT: exit 4 at start on every rank, not mid-run
            raise CheckpointStorageError(problem)
        self.restored_from = None
        step = None
        if self.cfg.resume:
            step = self._load_snapshot(state, while_copying or (lambda: None))
            if step is None:
                step = self._load_newest_valid(state)
        if step is None and self.cfg.init_from:
            self._warm_start(state)
        forgotten = self.snapshots.forget_after(step)
        if forgotten:
            log.info("forgot the snapshots of steps %s: newer than the restored step %s, not held by every rank",
                     forgotten, step)
        self.loaded_step = step
        self.policy.next_due = max(self.policy.next_due, (step or 0) + 1)
        self._prepare_slots(state)
        return step

    def _prepare_slots(self, state: dict[str, Any]) -> None:
        """Have the snapshot slots reserved in the background from the end of the first step (the first ``save``
        call), so the first memory checkpoint is cheap and the restore and the first step run alone."""
        model = [local_piece(v) for v in flatten(state, model_only=True)[0].values()]
        device = next((t.device for t, _ in model if t.is_cuda), torch.device("cpu"))
        self.snapshots.prepare(_predicted_bytes([p for _, p in model], _SLOT_ALIGN), device)

    # ---- memory checkpoints ----------------------------------------------------------------------------------
    def _agree(self, step: int) -> tuple[bool, bool, float, float]:
        """(a free slot on every rank, no write in flight on any rank, step time, snapshot cost): one all-reduce."""
        step_s, cost_s = self.policy.measurements()
        free = self.snapshots.choose() is not None
        idle = self._persist is None  # an abandoned write is cleared by save()'s poll once it finished
        values = [float(-free), float(-idle), step_s, cost_s]
        if self.world_size > 1:
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
            values = tensor.tolist()
        return values[0] < 0, values[1] < 0, values[2], values[3]

    def _stage(self, slot: Slot, step: int, state: dict[str, Any]) -> None:
        locals_, pieces, optim_extra = local_tensors(state)
        on_cuda = any(t.is_cuda for t in locals_.values())
        if on_cuda and self._stream is None:
            self._stream = torch.cuda.Stream()
        payload = {
            "format": FORMAT, "version": VERSION, "step": step, "rank": self.rank, "world_size": self.world_size,
            "rank_state": rank_state(state), **optim_extra, "config_json": self.config_json,
        }
        self.snapshots.stage(slot, step, locals_, pieces, payload, self._stream)

    def _complete_staging(self) -> None:
        """The staged slot becomes a snapshot (CUDA: waits for its copy); a write waiting for it is submitted."""
        slot = self.snapshots.staged()
        if slot is not None:
            self.snapshots.complete(slot)
        persist = self._persist
        if persist is not None and not persist.submitted and persist.slot.step == persist.step:
            self._submit(persist, inline=not self.cfg.async_save)

    def _record_interval(self, interval: int, step_s: float, cost_s: float) -> None:
        log.info("checkpoint.interval=auto: a memory checkpoint every %d steps (Young/Daly: snapshot cost %.4f s, "
                 "step %.4f s, MTBF %.0f s)", interval, cost_s, step_s, self.cfg.mtbf_s)
        self.event_sink("checkpoint_interval", steps=interval, cost_s=round(cost_s, 5), step_s=round(step_s, 5),
                        mtbf_s=self.cfg.mtbf_s)

    # ---- the persistent tier ---------------------------------------------------------------------------------
    def _start_persist(self, slot: Slot, step: int) -> None:
        tmp_dir = self.dir / (step_dir_name(step) + TMP_SUFFIX)
        tmp_dir.mkdir(parents=True, exist_ok=True)
        self._persist = _Persist(step, slot, tmp_dir, shard_file_name(self.rank, self.world_size))
        slot.locked = True

    def _submit(self, persist: _Persist, inline: bool) -> None:
        slot = persist.slot
        assert slot.buffer is not None
        persist.submitted = True
        if self.rank == 0:
            problem = storage.make_room(self.dir, self._save_bytes)  # FT: retention frees space before a save
            if problem:
                persist.report = {"ok": False, "errno": errno.ENOSPC, "error": problem}
                return
        self.writer.submit(slot.data_path, slot.buffer.numel(), slot.layout, slot.payload,
                           persist.tmp_dir / persist.file, test_fault(persist.step), inline=inline)

    def _local_done(self, blocking: bool) -> bool:
        persist = self._persist
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

    def _poll_persist(self, blocking: bool) -> None:
        """Commit the write in flight once every rank's writer finished it. Ranks agree by polling (one tiny
        all-reduce per poll) rather than by blocking in a collective while a peer still writes."""
        persist = self._persist
        assert persist is not None
        if persist.abandoned:  # only this rank's writer is waited for, never a collective
            if self._local_done(blocking):
                persist.slot.locked = False
                self._persist = None
            return
        while True:
            done = persist.submitted and self._local_done(blocking=False)
            if self.world_size > 1:
                flag = torch.tensor([int(done)])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
                done = bool(flag.item())
            if done or not blocking:
                break
            self._keep_alive_while_written(persist)
            time.sleep(_COMMIT_POLL_S)
        if done:
            self._commit()

    def _keep_alive_while_written(self, persist: _Persist) -> None:
        """FT: heartbeats stop while the loop waits on the disk, and a write's progress cannot be seen (the page
        cache takes the bytes at once, fsync waits). Send them for as long as a write of this shard may take on
        storage of ``checkpoint.min_write_mbps``; after that the write is taken for a hung disk."""
        now = time.monotonic()
        if persist.keepalive_until is None:
            assert persist.slot.buffer is not None
            persist.keepalive_until = now + _WRITE_GRACE_S + persist.slot.buffer.nbytes / (self.cfg.min_write_mbps * 1e6)
        if now <= persist.keepalive_until:
            if now - persist.alive_at >= _KEEPALIVE_S:
                persist.alive_at = now
                self.keepalive()
        elif persist.alive_at <= persist.keepalive_until:  # the budget just ran out: say so once
            persist.alive_at = now
            log.warning("step %d's write is taking longer than its shard at checkpoint.min_write_mbps=%g allows: "
                        "the liveness signals stop (the recovery layers restart a rank stuck on a hung disk)",
                        persist.step, self.cfg.min_write_mbps)

    def _drain_persist(self) -> None:
        while self._persist is not None:
            if not self._persist.submitted:
                self._complete_staging()
            self._poll_persist(blocking=True)

    def _persist_final(self, slot: Slot) -> None:
        """The final save of a snapshot already in memory: commit it to disk (synchronously)."""
        if self._persist is not None and self._persist.slot is slot and not self._persist.abandoned:
            self._drain_persist()
            return
        if self.last_committed == slot.step:
            return
        self._drain_persist()
        self._start_persist(slot, slot.step)  # type: ignore[arg-type]
        self._complete_staging()
        self._drain_persist()

    def _commit(self) -> None:
        persist = self._persist
        assert persist is not None and persist.report is not None
        mine = {"rank": self.rank, "file": persist.file, "report": persist.report,
                "pieces": {k: [list(p.offset), list(p.shape)] for k, p in persist.slot.pieces.items()}}
        everyone = self._all_gather((persist.step, mine))
        outcome: dict[str, Any] = {"ok": True}
        if self.rank == 0:
            outcome = self._commit_on_rank0(persist, [m for s, m in everyone if s == persist.step], len(everyone))
        outcome = self._broadcast(outcome)
        persist.slot.locked = False
        self._persist = None
        if not outcome["ok"]:
            raise CheckpointStorageError(outcome["message"])
        self.last_committed = persist.step

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
            message = (storage.disk_full_message(self.dir, int(self._save_bytes * storage.SIZE_MARGIN))
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
            shutil.rmtree(self.dir / step_dir_name(step), ignore_errors=True)
            log.info("retention (keep=%d): removed %s", self.cfg.keep, self.dir / step_dir_name(step))
        for tmp in self.dir.glob(f"step-*{TMP_SUFFIX}"):  # abandoned writes, finished by every rank by now
            if tmp.name[5 : 5 + 8].isdigit() and int(tmp.name[5 : 5 + 8]) < committed:
                shutil.rmtree(tmp, ignore_errors=True)

    def _estimate_save_bytes(self, state: dict[str, Any]) -> int:
        """The bytes of one persistent checkpoint, summed over ranks (exact once the optimizer has state)."""
        if state["optimizer"].state:
            mine = sum(p.dtype.itemsize * _numel(p.shape) for p in local_tensors(state)[1].values())
        else:
            mine = _predicted_bytes([local_piece(v)[1] for v in flatten(state, model_only=True)[0].values()], 1)
        return int(sum(self._all_gather(mine)))

    # ---- loading (collective) ---------------------------------------------------------------------------------
    def _remove_incomplete(self) -> None:
        if self.rank == 0 and self.dir.is_dir():
            keep = self._persist.tmp_dir if self._persist is not None else None
            for tmp in self.dir.glob(f"step-*{TMP_SUFFIX}"):
                if tmp != keep:
                    log.warning("removing %s: a save that never committed (the process stopped mid-write)", tmp)
                    shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()

    def _load_snapshot(self, state: dict[str, Any], while_copying: Callable[[], None]) -> int | None:
        """The memory or node-local tier: the newest step every rank holds and verifies, if not older than disk."""
        in_process = any(s.buffer is not None for s in self.snapshots.slots)
        held = self.snapshots.discover(lambda: local_tensors(state)[1])
        common = set(held)
        for other in self._all_gather(held):
            common &= set(other)
        newest_disk = self._broadcast((committed_steps(self.dir) or [None])[-1] if self.rank == 0 else None)
        for step in sorted(common, reverse=True):
            if newest_disk is not None and step < newest_disk:
                break
            slot = self.snapshots.slot_for(step)
            assert slot is not None
            live, _ = flatten(state)
            targets = {}
            for key, value in live.items():
                dst, piece = local_piece(value)
                if key not in slot.views or slot.pieces.get(key, piece) != piece:
                    raise CheckpointError(f"snapshot has no matching {key}; the model changed")
                targets[key] = dst
            with torch.no_grad():  # FT: verified while copied in (on the GPU: page-locked in chunks, checked there)
                problem = self.snapshots.restore(step, targets, while_copying)
            problems = [p for p in self._all_gather(problem) if p]
            if problems:  # the tensors copied so far are overwritten by whatever is loaded next
                log.warning("node-local snapshot of step %d is unusable (%s); trying the next tier", step, problems[0])
                continue
            apply(state, live, slot.payload)
            self.restored_from = "memory" if in_process else "node-local"
            log.info("restored step %d from the %s tier (%s)", step, self.restored_from,
                     "in-process restart: no file read" if in_process else f"{self.snapshots.dir}: no checkpoint file read")
            return step
        return None

    def _load_newest_valid(self, state: dict[str, Any]) -> int | None:
        tried: list[str] = []
        while True:
            candidates = committed_steps(self.dir) if self.rank == 0 else []
            step = self._broadcast(candidates[-1] if candidates else None)
            if step is None:
                break
            step_dir = self.dir / step_dir_name(step)
            started = time.perf_counter()
            manifest, reason, message = read_manifest(step_dir)
            problems = [(reason, message)] if manifest is None else self._check_files(step_dir, manifest, state)
            problems = [p for per_rank in self._all_gather(problems) for p in per_rank]
            if not problems:
                self._restore_from_disk(state, step_dir, manifest)  # type: ignore[arg-type]
                self.restored_from = "disk"
                log.info("restored step %d from %s (verified while read: %.2f s)", step, step_dir,
                         time.perf_counter() - started)
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
        return verify_shards(step_dir, manifest, ranks, self.cfg.verify_checksums) or probe_loadable(step_dir, manifest, ranks)

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

    def _warm_start(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        step_dir, manifest = find_valid_checkpoint(Path(self.cfg.init_from), checksums=self.cfg.verify_checksums)
        shards = Shards(step_dir, manifest)
        live, _ = flatten(state, model_only=True)
        for key, value in live.items():
            dst, piece = local_piece(value)
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


_SLOT_ALIGN = 64  # slots.plan_layout's alignment


def _predicted_bytes(model: list[Piece], align: int) -> int:
    """This rank's state predicted from the model alone (the optimizer may have no state yet, and creating it
    here would change a fresh run): each parameter, AdamW's two fp32 moments and its step, each ``align``ed."""
    def aligned(nbytes: int) -> int:
        return -(-max(nbytes, 1) // align) * align

    return sum(aligned(p.dtype.itemsize * _numel(p.shape)) + 2 * aligned(4 * _numel(p.shape)) + aligned(8)
               for p in model)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
