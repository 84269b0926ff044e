"""A new snapshot slot's population (``chunked.populate``, through ``slots.map_file``): every page of a fallocated
tmpfs file mapped ahead of the page-locking and the first copy, on a few threads of its own."""

from __future__ import annotations

import threading
import time

import torch


def test_a_new_slot_on_a_memory_file_system_has_every_page_mapped_and_an_existing_one_keeps_its_bytes():
    """``chunked.populate``: the first write to each page of a fallocated tmpfs file happens in ``map_file``, on
    several threads, not page by page inside the page-locking or the first copy. Read from /proc/self/smaps: the
    mapping's resident pages."""
    import shutil
    import tempfile
    from pathlib import Path

    from trainer.checkpoint.slots import map_file

    def mapped_kib(path: Path) -> int:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.rstrip().endswith(str(path))]
        assert len(starts) == 1, starts
        return next(int(line.split()[1]) for line in lines[starts[0]:] if line.startswith("Rss:"))

    directory = Path(tempfile.mkdtemp(prefix="resilient-train-test-", dir="/dev/shm"))
    try:
        nbytes = 8 << 20
        fresh = map_file(directory / "fresh.data", nbytes, allocate=True)
        assert mapped_kib(directory / "fresh.data") == nbytes // 1024 and int(fresh.count_nonzero()) == 0
        (directory / "kept.data").write_bytes(bytes(range(256)) * (nbytes // 256))
        kept = map_file(directory / "kept.data", nbytes, allocate=True)
        assert mapped_kib(directory / "kept.data") == 0  # not populated: its bytes are a snapshot's
        assert bytes(kept[:256].tolist()) == bytes(range(256)) and int(kept[4096]) == 0
        del fresh, kept
    finally:
        shutil.rmtree(directory)


def test_population_runs_on_its_own_threads_only_whatever_the_intra_op_pool(monkeypatch):
    """``chunked.populate`` touches every page of a new slot from its own few threads: none of its torch calls fans out
    over the intra-op (OpenMP) pool. With 16 intra-op threads, each populating thread's whole-range call made a team of
    16 (~130 threads for 8 populating threads on a 16-CPU host) that starved the training loop. Counted from
    /proc/self/task while it runs; the threads split the CPUs among the node's local ranks."""
    import os
    import tempfile
    from pathlib import Path

    from trainer.checkpoint import chunked
    from trainer.checkpoint.slots import map_file

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert chunked.populate_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert chunked.populate_threads() == chunked.POPULATE_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 threads, each with more pages than one call may touch
    assert chunked.populate_threads() == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(16)
    torch.ones(1 << 22).sum()  # the calling thread's own team exists before the count
    before = len(os.listdir("/proc/self/task"))
    peak, stop = [before], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(os.listdir("/proc/self/task")))
            time.sleep(0.0005)

    directory = Path(tempfile.mkdtemp(prefix="resilient-train-test-", dir="/dev/shm"))
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        slot = map_file(directory / "fresh.data", 1 << 30, allocate=True)
        stop.set()
        watcher.join()
        assert int(slot[::chunked.PAGE_BYTES].count_nonzero()) == 0
        del slot
    finally:
        stop.set()
        torch.set_num_threads(threads)
        (directory / "fresh.data").unlink(missing_ok=True)
        directory.rmdir()
    # the watcher and the 2 populating threads, with room for 5 more from elsewhere in this process (a daemon thread
    # of an earlier test); a fanned-out call adds 15 per populating thread
    assert peak[0] - before <= 1 + 2 + 5, (before, peak[0])
