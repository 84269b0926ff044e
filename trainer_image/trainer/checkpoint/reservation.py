"""Reserving a rank's snapshot slots ahead of its first snapshot: the one concern of this module.

A new process's slots are files it creates, faults in and (on CUDA) page-locks before a snapshot can land in them
(the ``1b`` model: ~17 GiB a slot). Until a slot is ready, a snapshot due is deferred (CUDA) or waits (CPU), so the
sooner the slots are ready, the sooner a new process has a restore point that survives a SIGKILL. Two stages, each
slot in turn, the slot the next snapshot goes into first:

- **populate** (CUDA): the files are allocated and their pages faulted in (``chunked.populate``, several threads)
  from the end of the restore (``prepare``), while the start's warm-up and first step run. It is CPU and memory work
  only: no CUDA call, so it never holds the driver the training thread launches through;
- **page-lock** (``start_prepare``, from the end of the first step; the slots mapped already first, then those being
  populated, each in its turn): each slot registered with the driver in pieces,
  pausing after each as long as it took, so that the training thread's launches get the driver in between (a
  registration holds it; during the restore and the first step it doubled a respawned worker's recovery, measured on
  H200). A snapshot that waits for its slot (``urgent``) ends the pauses. On CPU this stage maps the files itself.

A slot is ``ready`` once both stages are done (``Slot.ready``); ``deferring`` says whether the next snapshot would
be deferred for it. Slots a previous process published (a restart's) are mapped already and only page-locked.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from trainer.checkpoint import chunked
from trainer.checkpoint.slots import Slot, SnapshotStore, map_file

log = logging.getLogger(__name__)


def left_to_lock(slot: Slot, nbytes: int) -> int:
    """Bytes of ``slot`` still to page-lock before it is ready: all of a slot not mapped yet, none of one pinned, the
    rest beyond the chunks a restore or the standby registered (``Slot.chunk_pins``: kept where the slot's pieces
    are those chunks, registered again otherwise)."""
    if slot.buffer is None or slot.buffer.numel() < nbytes:
        return nbytes
    if slot.pinned or slot.pin_refused:
        return 0
    kept = len(slot.chunk_pins) * chunked.CHUNK_BYTES if slot.pin_piece == chunked.CHUNK_BYTES else 0
    return max(0, slot.buffer.numel() - kept)


class Reservation:
    """The background reservation of one ``SnapshotStore``'s slots, once per process (in-process restarts keep
    the slots)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.defer_unready: bool | None = None
        """Whether a snapshot whose slot is still being reserved is deferred instead of waited for (``ready``); None:
        when the reservation page-locks (CUDA), which takes seconds after a new process's first step."""
        self._request: tuple[int, torch.device] | None = None
        self._started = False
        self._urgent = threading.Event()
        self._lock = threading.Lock()
        self._populated: dict[int, threading.Event] = {}
        self.threads: list[threading.Thread] = []

    def prepare(self, nbytes: int, device: torch.device) -> None:
        """Ask for every slot to be reserved (at least ``nbytes``, page-locked on CUDA) ahead of the first snapshot.
        On CUDA the slots' files are populated from now on; page-locking starts at ``start_prepare``."""
        if self._started:  # once per process
            return
        self._request = (nbytes, device)
        fresh = [slot for slot in self._order() if slot.buffer is None and slot.index not in self._populated]
        if device.type != "cuda" or not fresh:
            return
        for slot in fresh:
            self._populated[slot.index] = threading.Event()
            slot.ready.clear()  # nothing stages into it (a snapshot at a fault in the first step) while it is mapped

        def populate() -> None:
            began = time.perf_counter()
            for slot in fresh:
                try:
                    self.store.dir.mkdir(parents=True, exist_ok=True)
                    slot.buffer = map_file(slot.data_path, nbytes, allocate=True)
                    log.info("snapshot slot %d populated %.2f s after the restore", slot.index,
                             time.perf_counter() - began)
                except Exception as exc:  # the page-locking stage maps it again and reports it
                    log.warning("snapshot slot %d not populated ahead: %s", slot.index, exc)
                finally:
                    with self._lock:
                        self._populated[slot.index].set()
                        if not self._started:  # no page-locking asked for yet: usable as it is
                            slot.ready.set()

        self._spawn(populate, "snapshot-populate")

    def start_prepare(self) -> None:
        """Reserve the slots asked for by ``prepare`` in a background thread (once per process; called after the
        first step). A snapshot waits only for its own slot (or is deferred: ``deferring``)."""
        if self._request is None or self._started:
            return
        (nbytes, device), self._request = self._request, None
        pin = device.type == "cuda"
        self.defer_unready = pin if self.defer_unready is None else self.defer_unready
        # FT: a slot mapped already (a restart's: page-locked ahead by the standby, or the dead worker's) is made ready
        # first, in moments; one still being populated would hold it for seconds behind it. Among the mapped ones, the
        # one with the least left to page-lock goes first: the next snapshot takes the first slot ready
        order = sorted(self._order(), key=lambda slot: (slot.index in self._populated, left_to_lock(slot, nbytes)))
        with self._lock:
            self._started = True
            for slot in order:
                slot.ready.clear()

        def run() -> None:
            began = time.perf_counter()
            try:
                self.store.dir.mkdir(parents=True, exist_ok=True)
                if pin:
                    torch.cuda.set_device(device)  # pinned for this rank's GPU context
                for slot in order:
                    if slot.index in self._populated:
                        self._populated[slot.index].wait()
                    # FT: paced while no save waits for a slot; a save that does ends the pauses (urgent)
                    slot.reserve(nbytes, pin, keep_content=slot.step is not None, pause=self._urgent.wait)
                    slot.ready.set()
                    log.info("snapshot slot %d reserved%s %.2f s after the first step", slot.index,
                             " and page-locked" if slot.pinned else "", time.perf_counter() - began)
            except Exception as exc:  # the first save reserves (and reports) it again
                log.warning("snapshot slots not prepared ahead of the first save: %s", exc)
            finally:  # never a slot the populate stage is still mapping
                for slot in order:
                    if slot.index in self._populated:
                        self._populated[slot.index].wait()
                    slot.ready.set()

        self._spawn(run, "snapshot-prepare")

    def urgent(self) -> None:
        """A snapshot waits for a slot being reserved: the page-locking stops pausing."""
        self._urgent.set()

    def deferring(self, slot: Slot | None) -> bool:
        """``slot``, the one the next snapshot goes into, is still being reserved and snapshots wait for none
        (``defer_unready``): the snapshot is deferred to the first step that finds it ready."""
        return bool(self.defer_unready) and slot is not None and not slot.ready.is_set()

    def join(self) -> None:
        """Wait for both stages (tests, ``close``)."""
        for thread in self.threads:
            thread.join()

    def _order(self) -> list[Slot]:
        newest = self.store.newest()
        return sorted(self.store.slots, key=lambda slot: slot is newest)

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()
