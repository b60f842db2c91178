"""Where a command's CPU goes, by process kind: run it, sample every process it starts twice a second, and
sum their CPU seconds by kind (a Ray worker by its actor or task name, Ray's daemons by name, the rest by
command line). Processes that were running before the command are left out.

    python benchmarks/cpu_by_process.py --out runs/cpu/test_app.json -- python -m pytest -q tests/serving/test_app.py

Linux only (reads /proc). A process that lives less than one interval is missed, and one that exits loses at
most its last interval; ``busy_core_s`` (all of the machine's busy time over the run, from /proc/stat) bounds
what is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
DAEMONS = ("gcs_server", "raylet", "dashboard/agent.py", "runtime_env/agent", "log_monitor", "dashboard.py",
           "monitor.py", "default_worker.py", "pytest")


def process_kind(cmdline: str) -> str:
    """``ray::Name`` for a Ray worker (its actor class or task, without the method), a daemon's name, else the
    command line's first 60 characters."""
    if cmdline.startswith("ray::"):
        return "ray::" + cmdline.split()[0][5:].split(".")[0][:40]
    return next((name for name in DAEMONS if name in cmdline), cmdline[:60])


def busy_core_seconds() -> float:
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def _cmdline(pid: str) -> str | None:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return text or None


def _cpu(pid: str) -> tuple[str, float] | None:
    """(start time, user + system CPU seconds) of ``pid``, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    return rest[19], (int(rest[11]) + int(rest[12])) / TICK


def sample(command: list[str], interval_s: float = 0.5) -> dict:
    """Run ``command`` and return its return code, wall seconds, the machine's busy core-seconds and
    ``by_kind``: [kind, CPU seconds, processes] rows, most CPU first."""
    before = {pid for pid in os.listdir("/proc") if pid.isdigit()}
    before.add(str(os.getpid()))
    seen: dict[tuple[str, str], list] = {}
    busy0, start = busy_core_seconds(), time.monotonic()
    proc = subprocess.Popen(command)
    while True:
        done = proc.poll() is not None
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in before:
                continue
            cpu = _cpu(pid)
            if cpu is None:
                continue
            cmdline = _cmdline(pid)
            entry = seen.get((pid, cpu[0]))
            if entry is None:
                if cmdline is not None:
                    seen[(pid, cpu[0])] = [process_kind(cmdline), cpu[1]]
                continue
            entry[1] = cpu[1]
            if cmdline is not None:
                entry[0] = process_kind(cmdline)
        if done:
            break
        time.sleep(interval_s)
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for kind, cpu in seen.values():
        totals[kind][0] += cpu
        totals[kind][1] += 1
    rows = sorted(([kind, round(cpu, 1), n] for kind, (cpu, n) in totals.items()), key=lambda r: -r[1])
    return {"command": command, "returncode": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
            "busy_core_s": round(busy_core_seconds() - busy0, 1), "by_kind": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    result = sample(command, args.interval)
    print(f"{result['wall_s']} s wall, {result['busy_core_s']} busy core-s on the machine, rc {result['returncode']}")
    for kind, cpu, n in result["by_kind"][:30]:
        print(f"{cpu:9.1f} s  {n:4d}  {kind}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
