"""What a node-local snapshot slot costs the CUDA driver: populating, page-locking and the release after a SIGKILL.

``python bench/pin_probe.py --dir /dev/shm/probe --gib 16 [--slots 3] [--device-gib 60]`` prints one JSON line per
figure (the card's own numbers behind ``trainer/checkpoint/slots.py``'s reservation and ``resiliency/device.py``'s
wait for a dead worker's memory):

- ``populate_s``: fallocate and fault in a new slot file on the project's threads (``chunked.populate``);
- ``register_s`` / ``unregister_s``: ``cudaHostRegister`` of the populated mapping, in one call and in
  ``pin_chunk_mib`` pieces; ``register_fresh_s``: the same on a file whose pages are not yet faulted in;
- ``release_s``: a child holding ``--device-gib`` on the device and (or not) ``--slots`` page-locked slots is
  SIGKILLed; the seconds until NVML shows its device memory back, with and without the slots;
- ``release_variant_s`` (``--variants``): the same release with the slots page-locked, for each named variant:
  ``plain``; ``nice``: the child imports torch, makes its CUDA context and page-locks in a thread at nice 19, as a
  warm standby does before it becomes the worker (``trainer/startup/standby.py``); ``copin``: another live process
  has the same slot files page-locked too, as the next standby has; ``load``: one busy process per CPU at the normal
  priority while the child dies; ``active``: another process runs the standby's ``Premapper`` over the same slot
  files, still locking chunks when the child is killed (a standby warm for a few seconds); and ``+`` combinations
  (``nice+load``). With ``after`` in a variant, the probe itself registers three 4 GiB ranges of a
  fresh mapping of the first slot file (pages present, not in its page tables, as a takeover's restore finds them):
  one as soon as the memory is back, one 3 s later, one 3 s later still after ``madvise(MADV_POPULATE_WRITE)``
  faulted it in (``register_after_release_s``); ``exited_s``: when the killed child could be reaped.
Also the machine's transparent huge page settings for shared memory (``thp``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))


LOCKING_S = 0.5
"""``active``: the child is killed this long after the other process locked its first chunk."""


def emit(figure: str, **fields: object) -> None:
    print(json.dumps({"figure": figure, **fields}), flush=True)


def thp() -> None:
    fields = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            fields[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as exc:
            fields[name] = f"unreadable: {exc}"
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if " /dev/shm " in line]
    emit("thp", **fields, dev_shm=mounts[0] if mounts else None)


def new_slot(path: Path, nbytes: int, populate: bool, reuse: bool = False):  # -> torch.Tensor
    from trainer.checkpoint.slots import map_file

    if reuse and path.exists() and path.stat().st_size == nbytes:
        return map_file(path, nbytes)  # populated by an earlier round: its pages are still in memory
    path.unlink(missing_ok=True)
    if populate:
        return map_file(path, nbytes, allocate=True)  # fallocate + chunked.populate on a memory file system
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # the same file, its pages left to the first touch
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    os.close(fd)
    return map_file(path, nbytes)


def pinning(directory: Path, gib: float, piece_mib: int) -> None:
    import torch

    from trainer.checkpoint import chunked

    torch.zeros(1, device="cuda")
    nbytes = int(gib * 2**30)
    path = directory / "probe.data"
    began = time.perf_counter()
    buffer = new_slot(path, nbytes, populate=True)
    emit("populate_s", value=round(time.perf_counter() - began, 3), gib=gib, threads=chunked.POPULATE_THREADS)
    for label, piece in (("one call", 0), (f"{piece_mib} MiB pieces", piece_mib * 2**20)):
        began = time.perf_counter()
        addresses: list[int] = []
        if piece:
            assert chunked.register_in_pieces(buffer, piece, addresses)
        else:
            assert chunked.cuda_register(buffer.data_ptr(), nbytes)
            addresses = [buffer.data_ptr()]
        took = time.perf_counter() - began
        began = time.perf_counter()
        for address in addresses:
            chunked.cuda_unregister(address)
        emit("register_s", value=round(took, 3), unregister_s=round(time.perf_counter() - began, 3), gib=gib,
             how=label, gb_per_s=round(nbytes / took / 1e9, 2))
    del buffer
    buffer = new_slot(path, nbytes, populate=False)
    began = time.perf_counter()
    assert chunked.cuda_register(buffer.data_ptr(), nbytes)
    emit("register_fresh_s", value=round(time.perf_counter() - began, 3), gib=gib,
         how="one call, pages not faulted in before")
    chunked.cuda_unregister(buffer.data_ptr())
    del buffer
    path.unlink(missing_ok=True)


def holder(directory: Path, gib: float, slots: int, device_gib: float, nice: int = 0) -> None:
    """The child: device memory and page-locked slots held, then a line on stdout, then it waits to be killed. With
    ``nice``, the imports, the CUDA context and the page-locking happen in a thread at that nice value (the standby's
    warm-up thread), the main thread staying at the normal one."""
    def hold(out: list) -> None:
        if nice:
            os.nice(nice)  # this thread only (Linux); the threads it starts inherit it
        import torch

        from trainer.checkpoint import chunked

        held = torch.empty(int(device_gib * 2**30), dtype=torch.uint8, device="cuda")
        held.fill_(1)
        for index in range(slots):
            buffer = new_slot(directory / f"held-{index}.data", int(gib * 2**30), populate=True, reuse=True)
            assert chunked.register_in_pieces(buffer, 1 << 30, [])
            out.append(buffer)
        torch.cuda.synchronize()
        out.append(held)

    import threading

    kept: list = []
    thread = threading.Thread(target=hold, args=(kept,))
    thread.start()
    thread.join()
    print("held", flush=True)
    time.sleep(3600)


def premapping(directory: Path, slots: int) -> None:
    """The other process of ``active``: a CUDA context and the standby's ``Premapper`` over the held slot files; a
    line once its first chunk is locked, then it waits."""
    import torch

    from trainer.checkpoint.premap import Premapper

    torch.zeros(1, device="cuda")
    mapper = Premapper([str(directory / f"held-{index}.data") for index in range(slots)],
                       thread_init=lambda: torch.cuda.set_device(0))
    mapper.start()
    while mapper.locked_bytes() == 0 and not mapper.refused:
        time.sleep(0.005)
    print("premapping", flush=True)
    time.sleep(3600)


def used_bytes() -> int:
    import pynvml

    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used


def spawn_holder(directory: Path, gib: float, slots: int, device_gib: float, nice: int = 0) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, __file__, "--hold", "--dir", str(directory), "--gib", str(gib),
                              "--slots", str(slots), "--device-gib", str(device_gib), "--hold-nice", str(nice)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def registrations_after(mapping, killed: float, child: subprocess.Popen, reaped: float | None) -> dict:
    """``after``: the seconds to page-lock 4 GiB ranges of ``mapping`` (a torch.Tensor) right away, 3 s later, and
    3 s later again once populated; and when ``child`` exited (``reaped`` if it was already, else watched from
    another thread meanwhile)."""
    import ctypes
    import threading

    from trainer.checkpoint import chunked

    exited: list[float] = [] if reaped is None else [reaped]

    def watch() -> None:
        if reaped is None:
            child.wait()
            exited.append(time.perf_counter() - killed)

    watcher = threading.Thread(target=watch)
    watcher.start()
    piece, base, out = 4 << 30, mapping.data_ptr(), {}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for index, label in enumerate(("at_once", "later", "populated_later")):
        if index:
            time.sleep(3)
        address = base + index * piece
        if label == "populated_later":
            began = time.perf_counter()
            status = libc.madvise(address, piece, 23)  # MADV_POPULATE_WRITE (Linux 5.14)
            out["populate_s"] = round(time.perf_counter() - began, 3) if status == 0 else f"errno {ctypes.get_errno()}"
        began = time.perf_counter()
        assert chunked.cuda_register(address, piece)
        out[label] = round(time.perf_counter() - began, 3)
        chunked.cuda_unregister(address)
    watcher.join()
    out["exited_s"] = round(exited[0], 3)
    return out


def release(directory: Path, gib: float, slots: int, device_gib: float, variant: str = "") -> None:
    import pynvml

    pynvml.nvmlInit()
    parts = set(variant.split("+")) if variant else set()
    others: list[subprocess.Popen] = []
    if "after" in parts:  # the probe's own context, before the baseline is read
        import torch

        torch.zeros(1, device="cuda")
    if "copin" in parts:  # the next standby: the same files page-locked, a small context of its own
        others.append(spawn_holder(directory, gib, slots, 0.1))
    before = used_bytes()
    child = spawn_holder(directory, gib, slots, device_gib, nice=19 if "nice" in parts else 0)
    holding = used_bytes()
    if "active" in parts:
        others.append(subprocess.Popen([sys.executable, __file__, "--premap", "--dir", str(directory),
                                        "--slots", str(slots)], stdout=subprocess.PIPE, text=True))
        assert others[-1].stdout is not None and others[-1].stdout.readline().strip() == "premapping"
        time.sleep(LOCKING_S)
    if "load" in parts:
        others += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        time.sleep(0.5)
    killed = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    reaped = None
    while used_bytes() > before + (holding - before) * 0.05:
        if reaped is None and child.poll() is not None:
            reaped = time.perf_counter() - killed
        time.sleep(0.005)
    back = time.perf_counter() - killed
    if "after" in parts:  # a fresh mapping: the pages are in /dev/shm, none in the probe's page tables
        mapping = torch.from_file(str(directory / "held-0.data"), shared=True, size=int(gib * 2**30), dtype=torch.uint8)
        emit("register_after_release_s", variant=variant, gib=4, **registrations_after(mapping, killed, child, reaped))
    child.wait()
    for other in others:
        other.kill()
        other.wait()
    reaped = reaped if reaped is not None else back
    fields = dict(value=round(back, 3), reaped_s=round(reaped, 3), slots=slots, slot_gib=gib, device_gib=device_gib,
                  held_gib=round((holding - before) / 2**30, 2))
    if variant:
        emit("release_variant_s", variant=variant, **fields)
    else:
        emit("release_s", **fields)
        for index in range(slots):
            (directory / f"held-{index}.data").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/pin-probe"))
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--slots", type=int, default=3)
    parser.add_argument("--device-gib", type=float, default=60.0)
    parser.add_argument("--piece-mib", type=int, default=1024)
    parser.add_argument("--variants", default="", help="comma-separated release variants (the docstring's), "
                        "each run --rounds times in turn, instead of the other figures")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hold-nice", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--premap", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.premap:
        premapping(args.dir, args.slots)
        return
    if args.hold:
        holder(args.dir, args.gib, args.slots, args.device_gib, args.hold_nice)
        return
    thp()
    if args.variants:
        variants = args.variants.split(",")
        for variant in variants * args.rounds:
            release(args.dir, args.gib, args.slots, args.device_gib, variant)
        for index in range(args.slots):
            (args.dir / f"held-{index}.data").unlink(missing_ok=True)
        return
    pinning(args.dir, args.gib, args.piece_mib)
    for slots in (0, args.slots, 0, args.slots):
        release(args.dir, args.gib, slots, args.device_gib)


if __name__ == "__main__":
    main()
