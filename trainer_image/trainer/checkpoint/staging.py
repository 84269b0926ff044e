"""How a snapshot's tensors get into its slot: the only part of a memory checkpoint the training loop waits for.

The copy must be finished before the next ``optimizer.step()`` changes the tensors. Three ways, one per device
situation (``Copier.for_device``):

- ``HostCopy`` (CPU): the tensors are copied into the slot; the snapshot is complete when ``save`` returns.
- ``DirectCopy`` (CUDA): device-to-host copies into the pinned slot on a side stream, overlapping the next
  forward and backward; the loop waits for them before ``optimizer.step()``. A large state's copy (18 GB: 0.33 s
  at 55 GB/s) outlasts a step's forward and backward, so the step stalls for the rest.
- ``DeviceStagedCopy`` (CUDA, ``checkpoint.device_staging``): first device-to-device copies into a preallocated
  device buffer laid out like the slot (HBM: ~10 ms for 18 GB), which is all the next ``optimizer.step()``
  waits for (on the device: the host never blocks), then the buffer's device-to-host copy into the slot on the
  side stream, a part at the start of each following step (``Drain``: no more than half a step's worth in flight
  when a step ends). The slot becomes a snapshot when that drain finishes; the next snapshot is its only deadline.
  The node-local checksum is one reduction over the buffer.

Each copier sets on the slot the events ``SnapshotStore.complete`` and the manager wait for: ``slot.event``
(the host copy finished) and ``slot.sources_read`` (device staging: the sources were read; else None).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from trainer.checkpoint.chunked import SNAPSHOT_COPY_BYTES, device_checksum, pieces_of, split_copy
from trainer.checkpoint.slots import Layout, Slot, map_views
from trainer.startup.phases import STANDBY_DIR_ENV

log = logging.getLogger(__name__)

DEVICE_MARGIN_FRACTION = 0.05
"""``device_staging = "auto"`` keeps this fraction of the device's memory (at least ``DEVICE_MARGIN_MIN``) free
beside the staging buffer, above the peak the training steps so far have used."""
DEVICE_MARGIN_MIN = 2 * 2**30
STANDBY_DEVICE_BYTES = 3 * 2**29
"""What a warm standby of this local rank takes on the device beside the worker (its CUDA context and cuBLAS
workspace, with room for its prewarm), reserved by ``device_staging = "auto"`` where standbys run
(``TRAINER_STANDBY_DIR``): the standby is usually made after the first snapshot chose its copier."""
DRAIN_STEP_FRACTION = 0.5
"""Device staging: a snapshot's device-to-host drain is queued a part per step, each at most this fraction of a step
at the measured copy rate. The copy engine runs ready device-to-host copies in order, so a step's own small ones
(its loss for the log line) wait behind the drain in flight: queued whole (18 GB, 0.33 s), it held the step after
each ``1b`` snapshot 26 ms on H200 (a profile of ``train.profile_steps``), ~45 ms a snapshot in the goodput run."""
DRAIN_WITHIN_STEPS = 2
"""Device staging: the drain is queued in this many parts where the copy rate allows (the first at the start of the
step after the snapshot), so that the snapshot is a node-local restore point (it survives a SIGKILL) from the start
of the step after the last part landed: the third step after it was taken. A part is then larger than
``DRAIN_STEP_FRACTION`` of a step where the state needs it (``1b`` on H200: 18 GB, ~0.33 s at the copy rate, in
0.27 s steps), but never more than ``DRAIN_PART_MAX_FRACTION``: a part that outlasted its step would hold the next
step's own small copies; a state that large takes more parts."""
DRAIN_PART_MAX_FRACTION = 0.9
DRAIN_RATE_GUESS = 20e9
"""Bytes per second assumed for the first part, before a part's copy was timed (H200, PCIe 5: ~55e9)."""


class HostCopy:
    """CPU: a plain copy into the slot."""

    def copy(self, slot: Slot, tensors: dict[str, torch.Tensor], checksum: bool, after: Any = None) -> None:
        for key, src in tensors.items():
            slot.views[key].copy_(src.detach())  # also CPU-resident state (Adam step): a snapshot


class DirectCopy:
    """CUDA: device-to-host copies on ``stream`` straight into the pinned slot."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def copy(self, slot: Slot, tensors: dict[str, torch.Tensor], checksum: bool, after: Any = None) -> None:
        _wait(self.stream, after)
        with torch.cuda.stream(self.stream):
            for key, src in tensors.items():
                if slot.pinned and slot.pin_piece:  # one copy per page-locked piece
                    split_copy(slot.buffer, slot.layout[key][1], src.detach(), slot.pin_piece, to_slot=True)
                else:
                    slot.views[key].copy_(src.detach(), non_blocking=True)
            if checksum:
                _pending(slot).copy_(device_checksum(list(tensors.values())), non_blocking=True)
        slot.event = slot.sources_read = torch.cuda.Event()  # the copies read the live tensors until they land
        slot.event.record(self.stream)


class DeviceStagedCopy:
    """CUDA: device-to-device copies into ``buffer`` (the loop waits for those only), then the buffer's
    device-to-host copy into the slot in parts from the next steps' starts (``Drain``), all on ``stream``."""

    def __init__(self, stream: Any, buffer: torch.Tensor) -> None:
        self.stream, self.buffer = stream, buffer
        self.rate = DRAIN_RATE_GUESS
        self.timings: list[tuple[Any, Any, int]] = []
        """(start, end, bytes) of the drain parts queued and not yet measured (``drain_budget`` reads them)."""
        self._layout: Layout = {}
        self._views: dict[str, torch.Tensor] = {}
        self.step: int | None = None
        """The step whose tensors the buffer holds (set as their copy is queued). The buffer outlives an in-process
        restart, so the restore of that step copies it back on the device (``restore``), not from the host slot."""

    def copy(self, slot: Slot, tensors: dict[str, torch.Tensor], checksum: bool, after: Any = None) -> None:
        nbytes = max(offset + _nbytes(dtype, shape) for dtype, offset, shape in slot.layout.values())
        self.step = slot.staging
        if slot.layout != self._layout:
            if _words(nbytes) * 8 > self.buffer.numel():  # the state grew (not within a run: its tensors are fixed)
                self.buffer = torch.empty(_words(nbytes) * 8, dtype=torch.uint8, device=self.buffer.device)
            self.buffer.zero_()  # the padding between tensors counts as zeros in the checksum
            self._layout, self._views = slot.layout, map_views(self.buffer, slot.layout)
        on_device = [(self._views[k], t.detach()) for k, t in tensors.items() if t.is_cuda]
        on_host = [(k, t.detach()) for k, t in tensors.items() if not t.is_cuda]
        _wait(self.stream, after)
        with torch.cuda.stream(self.stream):
            for dst, src in on_device:  # a cudaMemcpyAsync each, on the copy engines: measured on H200 (1b, 588
                dst.copy_(src, non_blocking=True)  # tensors), it slowed the next step less than one fused copy kernel
            for key, src in on_host:  # rare (e.g. a CPU step counter): staged through the buffer as well
                self._views[key].copy_(src, non_blocking=True)
            slot.sources_read = torch.cuda.Event()
            slot.sources_read.record(self.stream)  # all the training stream waits for
            if checksum:  # one reduction over the buffer, zero padding included: the slot's checksum
                _pending(slot).copy_(self.buffer[: _words(nbytes) * 8].view(torch.int64).sum(), non_blocking=True)
            assert slot.buffer is not None
            if not slot.pinned:  # pageable: the copy is synchronous anyway
                slot.buffer[:nbytes].copy_(self.buffer[:nbytes], non_blocking=True)
        if slot.pinned:  # the drain: a part per step from the next step's start (Drain.pump)
            slot.event = Drain(self, slot.buffer, pieces_of(0, nbytes, slot.pin_piece, SNAPSHOT_COPY_BYTES))
        else:
            slot.event = torch.cuda.Event()
            slot.event.record(self.stream)

    def restore(self, slot: Slot, step: int, targets: dict[str, torch.Tensor]) -> bool:
        """Copy the snapshot of ``step`` (in ``slot``) into ``targets`` from the staging buffer, device to device
        after the buffer's own copies, where the buffer holds that step in the slot's layout; False (nothing copied)
        otherwise. The buffer is the slot's source byte for byte, and an in-process restart keeps the device's
        memory: the copy back takes HBM time instead of the host link's (``Recovery per layer`` in BENCHMARKS.md).
        A step whose copy into the buffer had not read its sources when the attempt ended never becomes a snapshot
        (``CheckpointManager._settle_staged``), so it is never asked for here."""
        if self.step != step or slot.layout != self._layout or not all(k in self._views for k in targets):
            return False
        training = torch.cuda.current_stream(self.buffer.device)
        training.wait_stream(self.stream)
        for key, target in targets.items():
            target.copy_(self._views[key], non_blocking=target.is_cuda)  # a CPU-resident one (a step count) waits
        training.synchronize()  # its time in the restore line is the copy's
        return True

    def drain_budget(self, step_s: float, remaining: int, steps_left: int | None, within: int | None = None) -> int | None:
        """Bytes of the next drain part (``drain_part_bytes``) at the copy rate measured so far."""
        done = [(start.elapsed_time(end) / 1e3, nbytes) for start, end, nbytes in self.timings if end.query()]
        self.timings = [t for t in self.timings if not t[1].query()]
        for seconds, nbytes in done:
            if seconds > 0 and nbytes >= SNAPSHOT_COPY_BYTES:
                self.rate = nbytes / seconds
        return drain_part_bytes(step_s, self.rate, remaining, steps_left, within)


def _wait(stream: Any, after: Any) -> None:
    """``stream`` waits for the training stream's work so far, or only for the CUDA event ``after`` (a snapshot at a
    fault: the step that finished whole, ``trainer/checkpoint/atfault.py``)."""
    if after is None:
        stream.wait_stream(torch.cuda.current_stream())
    else:
        stream.wait_event(after)


def drain_part_bytes(step_s: float, rate: float, remaining: int, steps_left: int | None,
                     within: int | None = None) -> int | None:
    """Bytes of a drain part queued at a step's start: ``DRAIN_STEP_FRACTION`` of a step (``step_s``) at ``rate``
    bytes/s; more where the ``remaining`` bytes would not land within ``within`` steps (this one included: the
    restore-point target, ``parts_left``), up to ``DRAIN_PART_MAX_FRACTION`` of a step; and whatever it takes to
    land them within the ``steps_left`` steps before the next snapshot is due, which waits for them. None: all at
    once (the step time is not measured yet, or no step is left)."""
    if step_s <= 0 or (steps_left is not None and steps_left <= 0):
        return None
    paced = int(DRAIN_STEP_FRACTION * step_s * rate)
    if within is not None and within > 0:
        paced = max(paced, min(-(-remaining // within), int(DRAIN_PART_MAX_FRACTION * step_s * rate)))
    return paced if steps_left is None else max(paced, -(-remaining // steps_left))


def parts_left(queued: int) -> int:
    """Parts the rest of a drain is spread over after ``queued`` parts, for the restore-point target
    (``DRAIN_WITHIN_STEPS`` in all)."""
    return max(1, DRAIN_WITHIN_STEPS - queued)


class Drain:
    """A device-staged snapshot's device-to-host copy into its pinned slot, as ``slot.event``: queued a part at a
    time (``pump``, at each step's start, after the training stream's work so far) so that the copy engine holds
    no more of it than fits in half a step when the step ends. ``query``/``synchronize`` as a CUDA event's
    (``synchronize`` queues the rest first)."""

    def __init__(self, copier: DeviceStagedCopy, slot_bytes: torch.Tensor, pieces: list[tuple[int, int]]) -> None:
        self.copier, self.slot_bytes, self.pieces = copier, slot_bytes, pieces
        self.done: Any = None
        self.parts = 0

    def pump(self, step_s: float = -1.0, steps_left: int | None = None, rest: bool = False) -> None:
        """Queue the next part (``step_s``: the step time; ``steps_left``: steps before the next snapshot is due,
        which waits for this drain), after the training stream's work so far; ``rest``: all that is left, at once
        (the staging buffer it reads is written on the drain's own stream: the order with training is only pacing,
        and a training stream held by a hung collective does not hold it)."""
        if self.done is not None:
            return
        remaining = sum(_length(p) for p in self.pieces)
        budget = None if rest else self.copier.drain_budget(step_s, remaining, steps_left, parts_left(self.parts))
        self.parts += 1
        stream, staged = self.copier.stream, self.copier.buffer
        if not rest:
            stream.wait_stream(torch.cuda.current_stream())
        start, end, queued = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 0
        with torch.cuda.stream(stream):
            start.record(stream)
            while self.pieces and (budget is None or not queued or queued + _length(self.pieces[0]) <= budget):
                a, b = self.pieces.pop(0)
                self.slot_bytes[a:b].copy_(staged[a:b], non_blocking=True)
                queued += b - a
            end.record(stream)
        self.copier.timings.append((start, end, queued))
        if not self.pieces:
            self.done = end

    def query(self) -> bool:
        return self.done is not None and bool(self.done.query())

    def synchronize(self) -> None:
        self.pump(rest=True)
        self.done.synchronize()


def _length(piece: tuple[int, int]) -> int:
    return piece[1] - piece[0]


def _pending(slot: Slot) -> torch.Tensor:
    if slot.pending_checksum is None:
        slot.pending_checksum = torch.zeros((), dtype=torch.int64, pin_memory=True)
    return slot.pending_checksum


def _nbytes(dtype_name: str, shape: tuple[int, ...]) -> int:
    n = getattr(torch, dtype_name).itemsize
    for d in shape:
        n *= d
    return n


def _words(nbytes: int) -> int:
    return -(-nbytes // 8)


def device_margin(total: int) -> int:
    """Bytes of a device of ``total`` bytes kept free for the training's growth (``DEVICE_MARGIN_FRACTION``)."""
    return max(DEVICE_MARGIN_MIN, int(DEVICE_MARGIN_FRACTION * total))


def device_staging_room(nbytes: int, device: torch.device) -> tuple[bool, str]:
    """Whether a staging buffer of ``nbytes`` fits on ``device`` beside the training's peak so far, a warm standby
    (where standbys run) and a margin, and the device's budget in those terms (for the log line): its total, what
    the steps so far allocated at most, the allocator's cache beyond that (reusable), what other CUDA contexts and
    processes hold, and what is left to spare (negative: short)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved, peak = torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device)
    cached_unused = max(0, reserved - peak)
    room = free + cached_unused
    margin = device_margin(total)
    standby = STANDBY_DEVICE_BYTES if os.environ.get(STANDBY_DIR_ENV) else 0
    spare = room - nbytes - margin - standby
    gib = 2**30
    numbers = (f"device memory of cuda:{device.index}, {total / gib:.1f} GiB: training peak {peak / gib:.1f}, allocator "
               f"cache beyond it {cached_unused / gib:.1f}, CUDA contexts and other processes "
               f"{max(0, total - free - reserved) / gib:.1f}, staging buffer {nbytes / gib:.1f}"
               + (f", a warm standby {standby / gib:.1f}" if standby else "")
               + f", margin {margin / gib:.1f}: {abs(spare) / gib:.1f} GiB {'to spare' if spare >= 0 else 'short'}")
    return spare >= 0, numbers


def choose_copier(mode: str, device: torch.device, nbytes: int, stream: Any) -> HostCopy | DirectCopy | DeviceStagedCopy:
    """The copier for ``checkpoint.device_staging`` (``auto``/``on``/``off``) on ``device``; logs its choice (once per
    process: the caller keeps the copier)."""
    if device.type != "cuda":
        return HostCopy()
    if mode == "off":
        return DirectCopy(stream)
    fits, numbers = device_staging_room(nbytes, device)
    if mode == "auto" and not fits:
        log.info("checkpoint.device_staging=auto: off, snapshots are copied straight to host memory (%s)", numbers)
        return DirectCopy(stream)
    try:
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        log.warning("checkpoint.device_staging=%s: no device memory for the staging buffer (%s); snapshots are copied "
                    "straight to host memory", mode, numbers)
        return DirectCopy(stream)
    log.info("checkpoint.device_staging=%s: on, the loop waits only for a device-to-device copy (%s)", mode, numbers)
    return DeviceStagedCopy(stream, buffer)
