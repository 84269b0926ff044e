"""The checkpoint manager: composes the three tiers. One per process; each attempt of ``train()`` brackets its use
with ``bind()`` (after the new process group exists) and ``unbind()``.

The loop calls ``save(step, state)`` every step; the manager decides when a memory checkpoint is due
(``checkpoint.interval``, or ``"auto"``: Young/Daly). A memory checkpoint stages this rank's local shards into a
snapshot slot (``slots``): the only part that blocks the loop (on CUDA the copy overlaps the next forward and
backward until ``wait_for_staging()``). Every ``persist_every``-th one is also written to ``checkpoint.dir`` by the
background writer (``writer``) and committed with the atomic manifest (``layout``); a write in flight is polled
with one tiny collective per step, so no rank ever waits in a collective for a slow disk.

``load_latest`` restores the newest step every rank can reach, each rank from its nearest tier that holds it: memory
(an in-process restart: no file is read), node-local (a worker respawned on the same node), else the persistent tier
(verified while it is read): ``restore``.
Decisions that must match across ranks (stage or skip, persist or not, the automatic interval) are agreed with
one small all-reduce at each due step, on the manager's own gloo group.
"""

from __future__ import annotations

import atexit
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer.startup import forkserver
from trainer.checkpoint import hostmem, reaper, reshard, storage
from trainer.checkpoint.atfault import Whole, WholeStep
from trainer.checkpoint.coordination import Coordination
from trainer.checkpoint.errors import CheckpointError, CheckpointStorageError
from trainer.checkpoint.layout import FORMAT, VERSION
from trainer.checkpoint.peerauth import PeerAuth, load_secret
from trainer.checkpoint.persistent import PersistentTier
from trainer.checkpoint.policy import IntervalPolicy, PersistPolicy, interval_mtbf
from trainer.checkpoint.replicas import Replicator
from trainer.checkpoint.reservation import Reservation
from trainer.checkpoint.restore import restore_newest
from trainer.checkpoint.slots import SnapshotStore, Slot, job_key, plan_layout, snapshot_dir
from trainer.checkpoint.staging import DeviceStagedCopy, Drain, choose_copier
from trainer.checkpoint.state import (
    LiveState, apply_rank_state, flatten, local_piece, predicted_bytes, rank_state,
)
from trainer.checkpoint.writer import Writer
from trainer.config import CheckpointConfig, ConfigError
from trainer.parallel import DistEnv

log = logging.getLogger(__name__)

SOURCES_WAIT_S = 1.0
"""How long an attempt's end waits for a snapshot's copy to have read the live tensors (``_settle_staged``): the
device's backlog when the host fails is about a step."""

_SLOT_ALIGN = 64  # slots.plan_layout's alignment
AUTO_SLOTS = (3, 2)
"""``checkpoint.memory_slots=auto``: the slot counts tried in order, the first that host memory holds taken."""


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
        storage.check_directory(self.dir, env.rank)  # FT: a bad checkpoint.dir is exit 4 at start, not at the first save
        slots = AUTO_SLOTS[0] if cfg.memory_slots == "auto" else int(cfg.memory_slots)  # auto: settled at restore
        self.snapshots = SnapshotStore(snapshot_dir(cfg.node_local_dir, self.dir), env.rank, slots,
                                       job_key(self.dir), config_json, cfg.node_local)
        self.snapshots.pin_in_pieces(cfg.pin_chunk_mib << 20)
        self.reservation = Reservation(self.snapshots)  # FT: the slots populated and page-locked ahead of snapshots
        # FT: a worker restarted in place removes what dead processes of the job left in node memory, and records
        # what it creates there itself (reaper)
        reaper.reap(self.snapshots.dir, files=False)
        reaper.record(self.snapshots.dir, env.rank)
        self.replicas = Replicator(self.snapshots, cfg.replicas, PeerAuth(load_secret(self.dir), self.snapshots.job)) \
            if cfg.node_local and cfg.replicas != 0 else None
        """The peer tier (``replicas``), its exchanges signed with the job's secret (``peerauth``): None when off
        (``checkpoint.replicas=0``, or no node-local tier)."""
        self.writer = Writer()
        self.coord = Coordination(coordination_timeout_s)
        self.persistent = PersistentTier(cfg, self.dir, config_json, self.coord, self.writer)
        self.persistent.keepalive = lambda: self.keepalive()
        self.mtbf_s, self.mtbf_basis = interval_mtbf(cfg, env.world_size)
        self.policy = IntervalPolicy(cfg.interval, self.mtbf_s)
        self.persist_policy = PersistPolicy(cfg.persist_every)
        self._stream: Any = None
        self._copier: Any = None
        """How snapshots are copied into their slots (``staging``), chosen at the first one (after the first steps)."""
        self._live = LiveState()
        self.whole = WholeStep()
        """The last step that finished whole, for ``snapshot_at_fault``: marked by the training loop."""
        self._bound = False
        self._sources_read_at_unbind = False
        """The staged snapshot's copy had read its sources when the last attempt ended (``_settle_staged``)."""
        self._closed = False
        self.rank, self.world_size = env.rank, env.world_size
        self.restored_from: str | None = None
        """The tier the last ``load_latest`` restored from: memory, node-local, peer, disk, or None."""
        self.bytes_read: dict[str, int] = {}
        """Bytes the last ``load_latest`` read on this rank per tier (memory, node-local, peer, disk)."""
        self.restore_overwrote = False
        """The last ``load_latest`` copied a step into the state that it then gave up on every rank (``restore``)."""
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
        self.coord.open()
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.snapshots.rebind(self.rank, self.world_size)
        reaper.record(self.snapshots.dir, self.rank)
        if self.replicas is not None:
            self.replicas.bind(self.coord)  # FT: who holds this rank's replicas, from this attempt's nodes
        self._bound = True
        self._live.invalidate()  # a new attempt builds a new model and optimizer
        self.whole.updating()  # and has finished no step yet
        staged = self.snapshots.staged()
        if staged is not None:  # the attempt ended while copying into that slot
            self._settle_staged(staged)
        self.persistent.rebind()

    def _settle_staged(self, slot: Slot) -> None:
        """An attempt ended (an in-process restart) while a snapshot was copied into ``slot``. When the copy had read
        its sources before the attempt ended (``unbind``), the rest of it (device staging: the drain, which reads only
        the staging buffer) is finished here and the slot is a snapshot: an exception or a hang a step after a
        snapshot restores that snapshot, not the one before. Otherwise the freed tensors may have been read after
        their release, or the device fails the copy: not a snapshot, the restore falls back. Its persisted write, if
        one was due, is dropped either way: another rank may have dropped its copy of the step."""
        step = slot.staging
        persist = self.persistent.inflight
        if persist is not None and persist.slot is slot:
            slot.locked, self.persistent.inflight = False, None
        if self._sources_read_at_unbind:
            try:
                self.snapshots.complete(slot)
                log.info("the snapshot of step %d, in flight when the attempt ended, is finished: a restore point",
                         step)
                return
            except Exception as exc:  # e.g. a sticky CUDA error: the device's copy cannot be trusted
                log.warning("the snapshot of step %d, in flight when the attempt ended, is dropped: %s", step, exc)
        try:
            if slot.event is not None:
                slot.event.synchronize()  # nothing may still write into the slot once it is chosen again
        except Exception as exc:
            log.warning("the copy into the snapshot slot of step %d failed: %s", step, exc)
        slot.staging, slot.event, slot.sources_read = None, None, None

    def unbind(self) -> None:
        """End of an attempt, normal or failed. No collectives (the process group may be broken): a write in
        flight keeps running and the next ``bind()`` decides about it."""
        # FT: runs in train()'s finally, also after a fault. Destroying this rank's coordination group closes its
        # sockets, so a peer blocked in one of the group's gloo collectives (they cannot be aborted) fails within a
        # second instead of waiting for the timeout, and its in-process restart can begin.
        self._bound = False
        staged = self.snapshots.staged()
        # FT: the host runs ahead of the device: a fault at the step after a snapshot often comes before its copy
        # read the tensors (the device still runs the snapshot's step); a healthy device gets there within a step
        self._sources_read_at_unbind = staged is not None and _landed(staged.sources_read, SOURCES_WAIT_S)
        self._live.invalidate()  # FT: the attempt's model and optimizer state are not kept alive past its end
        self.coord.close()

    def close(self, job_over: bool = False) -> None:
        """End of the process (idempotent; also registered with atexit): stop the writer, unmap the slots. An
        uncommitted write is abandoned (its ``.tmp`` directory is removed by the next run). ``job_over`` (no restart
        of this rank on this node is coming: ``reaper.restart_in_place_expected``) also removes this rank's
        node-local snapshots, and what dead processes of the job left there; otherwise they stay for a respawned
        worker, and ``entrypoint.sh`` removes the job's snapshot directory when the job ends."""
        if self._closed:
            return
        self._closed = True
        self._bound = False
        persist = self.persistent.inflight
        if persist is not None and not persist.abandoned:
            log.warning("checkpoint step %d was not committed before close(); it is abandoned", persist.step)
        self.persistent.inflight = None
        self.writer.stop(graceful=True)
        storage.wait_for_removals()  # what retention took out of the namespace is gone when the process ends
        if job_over:  # FT: and what dead processes of the job left on this node (a rank SIGKILLed before the end)
            reaper.forget_own()
            reaper.reap(self.snapshots.dir, files=True)
        if self.replicas is not None:  # its files first: the directory is removed once empty
            self.replicas.close(remove=job_over)
        self.reservation.join()
        self.snapshots.close(remove=job_over)

    # ---- the loop's interface -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], last_step: bool = False, force: bool = False) -> bool:
        """Called every step on every rank; takes a memory checkpoint when due (``interval``, ``last_step``) or
        ``force``d, and persists every ``persist_every``-th one (one due while the previous write is still in
        flight is deferred to the next memory checkpoint that finds the writer free: ``PersistPolicy``).

        ``force=True`` (preemption, SIGTERM) and ``last_step`` return only once the checkpoint is committed to
        disk; otherwise the call returns after staging. Returns True when a checkpoint of ``step`` was taken.
        Raises ``CheckpointStorageError`` when a write failed (e.g. disk full), naming the directory."""
        self._require_bound()
        self._after_first_step()
        self.policy.tick()
        self._complete_staging(wait=False)  # a copy that finished in the background: the slot becomes a snapshot
        if self.persistent.inflight is not None:
            self._poll_persist(step)  # one tiny collective per step while a write is in flight
        final = force or last_step
        if not (final or self.policy.due(step)):
            return False
        started = time.perf_counter()
        self._complete_staging(wait=True)  # the previous snapshot's copy (device staging: its drain) must be done
        newest = self.snapshots.newest()
        if newest is not None and newest.step == step:  # already taken (e.g. a forced save after the regular one)
            if final:
                self._persist_final(newest)
            return True
        if final:  # an older write still in flight is superseded (one state written, not two), or waited for
            self._older_write_before_final(step)
        free, idle, want, step_s, cost_s, preparing = self._agree(step)
        if preparing and not final:  # FT: a new process's slots are page-locked in the background; the loop goes on
            if self.policy.defer(step):
                log.info("memory checkpoint of step %d deferred: its snapshot slot is still being page-locked in the "
                         "background (a new process's first seconds); taken at the first step that finds it ready",
                         step)
            return False
        if self.policy.owed_since is not None:
            log.info("memory checkpoint deferred from step %d taken at step %d", self.policy.owed_since, step)
        if not free:  # every other slot is held by a write and none holds an older snapshot to fall back to
            log.warning("memory checkpoint of step %d skipped: no snapshot slot can be restaged while keeping a "
                        "complete snapshot to fall back to", step)
            return False
        slot = self.snapshots.choose()
        assert slot is not None
        self._stage(slot, step, state)
        if self.persist_policy.decide(step, want, idle, final, self.persistent.lag(step), self.persistent.writing()):
            self.persistent.start(slot, step)
        self._complete_staging(wait=final or not self.cfg.async_save)  # a copy that finished: submit its write
        if final or not self.cfg.async_save:
            self._drain_persist(step)
        self.blocking_s.append(time.perf_counter() - started)
        interval = self.policy.snapshot_taken(step, step_s, cost_s)
        if interval is not None:
            self._record_interval(interval, step_s, cost_s)
        return True

    def _after_first_step(self) -> None:
        """What the first step after a (re)start must not wait for starts at its end (the first ``save`` call): the
        snapshot slots' reservation and, for background writes, the writer process."""
        # FT: page-locking the slots holds the CUDA driver for seconds: not during the restore and the first step
        self.reservation.start_prepare()
        if self.cfg.async_save and self.cfg.persist_every > 0:
            self.writer.start()  # spawned (no fork server), it imports torch: not during the restore and first step

    def before_step(self, step: int) -> None:
        """Called at the start of ``step``: a snapshot whose copy landed since the last step's check becomes one
        (its node-local publication starts before this step's work); else the next part of a device-staged
        snapshot's drain to host memory is queued after the training stream's work so far (``staging.Drain``)."""
        self._complete_staging(wait=False)
        slot = self.snapshots.staged()
        if slot is not None and isinstance(slot.event, Drain):
            slot.event.pump(self.policy.measurements()[0], self.policy.steps_to_next(step))

    def wait_for_staging(self) -> None:
        """Called before ``optimizer.step()``, which changes the tensors a snapshot copies. CUDA: the training
        stream waits on the device (the host does not block) for the copies that read those tensors (the copier's
        ``sources_read``): with device staging the device-to-device copy, its drain to host memory going on in the
        background; otherwise the device-to-host copy. A slot whose copy finished becomes a snapshot and is handed
        to the writer when it is to be persisted. Never waits for the disk."""
        slot = self.snapshots.staged()
        if slot is None:
            return
        started = time.perf_counter()
        # once, on the device; the host never waits here for a copy (it did for a drain, which reads only the
        # staging buffer: from the second step after a save it queued the rest of the drain at once and held the
        # host thread for that step's forward, backward and the rest, 169 ms a snapshot on H200 (1b))
        if slot.sources_read is not None:
            torch.cuda.current_stream().wait_event(slot.sources_read)
            slot.sources_read = None
        self._complete_staging(wait=False)
        if self.blocking_s:
            self.blocking_s[-1] += time.perf_counter() - started

    def blocking_figures(self) -> dict[str, Any] | None:
        """How long this process's memory checkpoints held the training loop's host thread (``save`` from its
        decision to take one until it returned, plus any wait for the copy before the next step): count, median,
        90th percentile and max in seconds; None before the first."""
        if not self.blocking_s:
            return None
        ordered = sorted(self.blocking_s)
        p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]  # nearest rank
        return {"count": len(ordered), "median_s": round(statistics.median(ordered), 4), "p90_s": round(p90, 4),
                "max_s": round(ordered[-1], 4)}

    def snapshot_files(self) -> list[str]:
        """This rank's node-local slot files (a warm standby page-locks them ahead of an in-job restart); none
        without the node-local tier."""
        return [str(s.data_path) for s in self.snapshots.slots] if self.snapshots.node_local else []

    def latest_in_memory(self) -> Slot | None:
        """This rank's newest complete memory checkpoint, or None."""
        return self.snapshots.newest()

    def load_latest(self, state: dict[str, Any], while_copying: Callable[[], None] | None = None,
                    fresh: Callable[[], dict[str, Any]] | None = None) -> int | None:
        """Restore the newest checkpoint every rank can load (collective); returns its step, or None when training
        starts fresh. Tiers, nearest first: memory, node-local, persistent. An invalid persistent checkpoint is
        moved aside as ``step-X.corrupt-<reason>`` with an ERROR line and the previous one is tried; a bad
        node-local snapshot is ignored with a WARNING. Raises ``CheckpointError`` when checkpoints exist but none
        is valid. Without one, ``init_from`` warm-starts. ``while_copying`` runs while a snapshot (memory or
        node-local tier) is copied in, before its non-tensor state (RNG, data position) is applied. ``fresh`` builds
        the training state as a fresh start has it: when a step was copied in and then given up (a rank's copy of
        it failed its check) and no other step is left, ``state``'s entries are replaced by ``fresh()``'s and its
        step, RNG and data position put back as they were before the restore."""
        self._require_bound()
        began = time.perf_counter()
        if self.cfg.async_save and self.cfg.persist_every > 0 and forkserver.available():
            self.writer.start()  # FT: forked, it costs no import: ready long before the first persist falls due
        self.persistent.remove_incomplete()
        self.persistent.save_bytes = self.persistent.estimate_save_bytes(state)
        problem = storage.room_problem(self.dir, self.persistent.save_bytes, self.cfg.keep) if self.rank == 0 else ""
        problem = self._broadcast(problem)
        if problem:  # FT: exit 4 at start on every rank, not mid-run
            raise CheckpointStorageError(problem)
        self.restored_from, self.bytes_read = None, {}
        self._check_host_memory(state)  # FT: exit 2 at start, not a full /dev/shm mid-run
        step, before = None, rank_state(state)
        unstepped = not state["optimizer"].state
        self.snapshots.restore_times = {"checks": time.perf_counter() - began}  # the restore line's first part
        if self.cfg.resume:  # FT: each rank from its nearest tier that holds the newest step every rank can reach
            if unstepped and callable(init := getattr(state["optimizer"], "init_state", None)):
                init()  # the state's tensors made directly, not by the state-dict API's zero step
            step = restore_newest(self, state, while_copying or (lambda: None))
            if self.env.local_rank == 0 and reshard.drop_other_worlds(self.snapshots):  # the restore is over everywhere
                log.info("removed this node's replicas of another world size (the job changed size)")
        if step is None and self.restore_overwrote:
            self._start_over(state, fresh, before)
        elif step is None and unstepped:
            # The tiers were looked at with the optimizer's state made ahead (``init_state``; for another optimizer,
            # the state-dict API's zero-gradient step at lr 0, whose step count 1 the first real step's bias correction
            # would use): a fresh start begins without it, as a first step makes it.
            state["optimizer"].state.clear()
        if step is None and self.cfg.init_from:
            self.persistent.warm_start(state)
        forgotten = self.snapshots.forget_after(step)
        if forgotten:
            log.info("forgot the snapshots of steps %s: newer than the restored step %s, not held by every rank",
                     forgotten, step)
        self.persistent.loaded_step = step
        self._live.invalidate()  # a restore may have replaced the optimizer's state tensors
        self.policy.next_due = max(self.policy.next_due, (step or 0) + 1)
        self._prepare_slots(state)
        return step

    def _start_over(self, state: dict[str, Any], fresh: Callable[[], dict[str, Any]] | None,
                    before: dict[str, Any]) -> None:
        """The restore gave up every step after copying one in: ``state`` holds some of it (all of it on the ranks
        whose copy verified), so it is built afresh (every rank alike: the decision was collective)."""
        if fresh is None:
            raise CheckpointError("no checkpoint every rank can restore, and the one tried was partly copied into the "
                                  "training state before it failed its check: restart the job to start over")
        log.warning("no step every rank can restore is left after the refused copies above: training starts over "
                    "from step 0 on freshly built state, on every rank")
        state.clear()  # this rank's model and optimizer go before the new ones are built beside them
        state.update(fresh())
        apply_rank_state(state, before)
        self.restored_from = None

    def _check_host_memory(self, state: dict[str, Any]) -> None:
        """This node's slots and replicas against its node-local directory and memory limit (``hostmem``);
        ``memory_slots=auto`` takes the most of ``AUTO_SLOTS`` that fits, said in one line when it is not the first;
        every rank's slot size to the peer tier (``Replicator.expect``)."""
        if not self.cfg.node_local:
            return
        model = [local_piece(v)[1] for v in flatten(state, model_only=True)[0].values()]
        slot_bytes = predicted_bytes(model, _SLOT_ALIGN)
        if self.replicas is not None:  # FT/security: a put larger than its source's slot is refused (collective)
            self.replicas.expect(self.coord, slot_bytes)
        counts = AUTO_SLOTS if self.cfg.memory_slots == "auto" else (int(self.cfg.memory_slots),)
        for count in counts:
            replicas = count * self.replicas.count if self.replicas is not None else 0  # mirrored slots
            try:
                hostmem.check(self.snapshots.dir, slot_bytes, count, replicas, self.env.local_world_size)
            except ConfigError as exc:
                if count == counts[-1]:
                    raise
                shortfall = exc
                continue
            if count < len(self.snapshots.slots):
                del self.snapshots.slots[count:]
                if self.env.rank == 0:
                    log.warning("checkpoint.memory_slots=auto: %d slots per rank, not %d (%s); a fault while a "
                                "persistent write is in flight restores a snapshot as old as that write",
                                count, counts[0], shortfall)
            return

    def _prepare_slots(self, state: dict[str, Any]) -> None:
        """Have the snapshot slots reserved in the background from the end of the first step (the first ``save``
        call), so the first memory checkpoint is cheap and the restore and the first step run alone."""
        model = [local_piece(v) for v in flatten(state, model_only=True)[0].values()]
        device = next((t.device for t, _ in model if t.is_cuda), torch.device("cpu"))
        self.reservation.prepare(predicted_bytes([p for _, p in model], _SLOT_ALIGN), device)

    # ---- memory checkpoints ----------------------------------------------------------------------------------
    def _agree(self, step: int) -> tuple[bool, bool, bool, float, float, bool]:
        """(a slot to stage into on every rank, no write in flight on any rank, a persist due on some rank, step
        time, snapshot cost, a slot still being prepared on some rank), each the same on every rank: one
        all-reduce."""
        step_s, cost_s = self.policy.measurements()
        slot = self.snapshots.choose()
        free = slot is not None
        idle = self.persistent.inflight is None  # an abandoned write is cleared by save()'s poll once it finished
        want = self.persist_policy.wants()
        preparing = self.reservation.deferring(slot)
        values = self.coord.all_reduce([float(-free), float(-idle), float(want), step_s, cost_s, float(preparing)],
                                       dist.ReduceOp.MAX)
        return values[0] < 0, values[1] < 0, values[2] > 0, values[3], values[4], values[5] > 0

    def snapshot_at_fault(self, state: dict[str, Any] | None) -> None:
        """A failed attempt's end, before ``unbind``, on this rank alone (no collective): the last step that finished
        whole (``trainer/checkpoint/atfault.py``) staged into a free slot, where it is newer than any snapshot by
        ``atfault.MIN_STEPS`` and no snapshot is in flight. It becomes a snapshot at the next ``bind``."""
        newest = self.snapshots.newest()
        whole = self.whole.take(None if newest is None else newest.step)
        if whole is None or state is None or not self.cfg.snapshot_at_fault or self.snapshots.staged() is not None:
            return
        slot = self.snapshots.choose()
        if slot is None or not slot.ready.is_set():  # no slot free of a write, or one still being page-locked
            return
        try:
            self._stage(slot, whole.step, state, whole)
        except Exception as exc:  # e.g. a sticky CUDA error: the attempt's tensors cannot be read
            slot.staging, slot.event, slot.sources_read = None, None, None
            log.warning("no snapshot of step %d at the fault: %s", whole.step, str(exc).splitlines()[0] if str(exc) else exc)
            return
        log.info("snapshot of step %d, the last whole step before the fault, staged (the newest snapshot: %s)",
                 whole.step, "none" if newest is None else f"step {newest.step}")

    def _stage(self, slot: Slot, step: int, state: dict[str, Any], whole: Whole | None = None) -> None:
        locals_, pieces, optim_extra = self._live.get(state)
        if self._copier is None:
            device = next((t.device for t in locals_.values() if t.is_cuda), torch.device("cpu"))
            if device.type == "cuda":
                self._stream = torch.cuda.Stream(device)
            self._copier = choose_copier(self.cfg.device_staging, device, plan_layout(pieces)[1], self._stream)
        payload = {
            "format": FORMAT, "version": VERSION, "step": step, "rank": self.rank, "world_size": self.world_size,
            "rank_state": rank_state(state) if whole is None else whole.rank_state, **optim_extra,
            "config_json": self.config_json,
        }
        if not slot.ready.is_set():
            self.reservation.urgent()  # page-locking in pieces stops pausing: this snapshot waits for its slot
        self.snapshots.stage(slot, step, locals_, pieces, payload, self._copier, None if whole is None else whole.updated)

    def restore_on_device(self, slot: Slot, step: int, targets: dict[str, torch.Tensor]) -> bool:
        """An in-process restart's restore of ``step`` from the device staging buffer, where that buffer holds it
        (``DeviceStagedCopy.restore``); False: restore from the slot."""
        copier = self._copier
        return isinstance(copier, DeviceStagedCopy) and copier.restore(slot, step, targets)

    def _complete_staging(self, wait: bool = True) -> None:
        """The staged slot becomes a snapshot once its copy finished (``wait``: wait for it; else only when it
        has); a write waiting for it is submitted."""
        slot = self.snapshots.staged()
        if slot is not None and (wait or slot.event is None or slot.event.query()):
            self.snapshots.complete(slot)
        persist = self.persistent.inflight
        if persist is not None and not persist.submitted and persist.slot.step == persist.step:
            self.persistent.submit(persist, inline=not self.cfg.async_save)

    def _record_interval(self, interval: int, step_s: float, cost_s: float) -> None:
        log.info("checkpoint.interval=auto: a memory checkpoint every %d steps (Young/Daly: snapshot cost %.4f s, "
                 "step %.4f s, MTBF %.0f s: %s)", interval, cost_s, step_s, self.mtbf_s, self.mtbf_basis)
        self.event_sink("checkpoint_interval", steps=interval, cost_s=round(cost_s, 5), step_s=round(step_s, 5),
                        mtbf_s=round(self.mtbf_s, 1), basis=self.mtbf_basis)

    # ---- the persistent tier ---------------------------------------------------------------------------------
    def _poll_persist(self, step: int, blocking: bool = False) -> None:
        inflight = self.persistent.inflight
        committed = self.persistent.poll(blocking)
        if committed is not None:
            if inflight is not None:  # the planner's persisted write time (trainer.planning.costs)
                self.event_sink("persisted", sync=False, step=committed, at_step=step,
                                write_s=round(time.monotonic() - inflight.started_at, 3))
            caught_up = self.persist_policy.committed(committed, step)
            if caught_up is not None:
                self.event_sink("persist_behind", **caught_up)

    def _drain_persist(self, step: int) -> None:
        while self.persistent.inflight is not None:
            if not self.persistent.inflight.submitted:
                self._complete_staging()
            self._poll_persist(step, blocking=True)

    def _persist_final(self, slot: Slot) -> None:
        """The final save of a snapshot already in memory: commit it to disk (synchronously), writing it once: its
        own write in flight is waited for, a committed one is kept, an older write in flight is cancelled."""
        step = slot.step
        assert step is not None
        persist = self.persistent.inflight
        if persist is not None and persist.slot is slot and persist.step == step and not persist.abandoned:
            self._drain_persist(step)
            return
        if self.persistent.last_committed == step:
            return
        self._older_write_before_final(step)
        self.persistent.start(slot, step)
        self._complete_staging()
        self._drain_persist(step)

    def _older_write_before_final(self, step: int) -> None:
        """``checkpoint.final_cancels_older_write``: cancel the write in flight, or let it commit first."""
        if self.cfg.final_cancels_older_write:
            self.persistent.cancel(superseded_by=step)
        else:
            self._drain_persist(step)

    # ---- collectives on the bound group -----------------------------------------------------------------------
    def _require_bound(self) -> None:
        if not self._bound:
            raise CheckpointError("CheckpointManager is not bound to a process group: call bind() after init_process_group")

    def _all_gather(self, obj: Any) -> list[Any]:
        return self.coord.all_gather(obj)

    def _broadcast(self, obj: Any) -> Any:
        return self.coord.broadcast(obj)


def _landed(event: Any, wait_s: float) -> bool:
    """A copy's CUDA event has completed, polled for up to ``wait_s`` (None: nothing pending, or the training stream
    already waits for it). A device that does not get there in time (a hung kernel ahead of the copy) or fails: no."""
    deadline = time.monotonic() + wait_s
    while event is not None:
        try:
            if event.query():
                return True
        except Exception:  # a device error: nothing of that copy is trusted
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True
