"""CPU time of a command and of every process below it, by process: `python bench/proc_cpu.py CMD ARGS...`.

Samples /proc every 0.1 s (a process's utime + stime at its last sample), so a process that lives under 0.1 s can be
missed and one's last 0.1 s may be; prints the command's wall time, the sampled total and each process above 0.05 s
of CPU with its command line, on stderr (the command's own output goes where it goes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def main(argv: list[str]) -> int:
    began = time.monotonic()
    root = subprocess.Popen(argv, start_new_session=True)
    seen: dict[int, tuple[float, str]] = {}
    while root.poll() is None:
        table, below = _table(), {root.pid}
        grew = True
        while grew:
            found = {pid for pid, (parent, _) in table.items() if parent in below} - below
            below |= found
            grew = bool(found)
        for pid in below & table.keys():
            try:  # the newest command line read (after an exec), but not a zombie's, which is empty
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:150]
                if "trainer.startup.forkserver" in cmd:  # its children share its command line; their names tell them apart
                    cmd = f"[{open(f'/proc/{pid}/comm').read().strip()}] {cmd}"
            except OSError:
                cmd = ""
            seen[pid] = (table[pid][1], cmd or seen.get(pid, (0.0, "?"))[1])
        time.sleep(0.1)
    total = sum(cpu for cpu, _ in seen.values())
    print(f"wall {time.monotonic() - began:.1f} s, sampled CPU {total:.1f} s over {len(seen)} processes", file=sys.stderr)
    for pid, (cpu, cmd) in sorted(seen.items(), key=lambda kv: -kv[1][0]):
        if cpu > 0.05:
            print(f"{cpu:6.2f} {pid} {cmd}", file=sys.stderr)
    return root.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
