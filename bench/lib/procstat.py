#!/usr/bin/env python3
"""CPU accounting and free ports for bench/proxy_bench.sh (standard library only).

    procstat.py ports N        N distinct free TCP ports on 127.0.0.1, one per line
    procstat.py ticks PID...   utime+stime clock ticks of the process trees rooted at PIDs
    procstat.py tree PID...    the PIDs of those process trees, one per line
    procstat.py core N         "busy total irq" clock ticks of CPU core N from /proc/stat
                               (irq = hardware + soft interrupt time, part of busy)

`ticks` sums fields 14 and 15 of /proc/PID/stat (which cover every thread of the process,
including exited ones) over each root and all its descendants, so an nginx master and its
workers, or a multi-threaded proxy, are counted whole.
"""

import os
import socket
import sys


def free_ports(count):
    """Binds `count` sockets to port 0 at once so the kernel hands out distinct ports."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def read_stat(pid):
    """Returns (ppid, utime + stime) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): field N is fields[N - 3].
    return int(fields[1]), int(fields[11]) + int(fields[12])


def process_table():
    """Returns ({ppid: [child pids]}, {pid: utime + stime}) for every live process."""
    children = {}
    cpu = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = read_stat(int(name))
        if stat is None:
            continue
        ppid, ticks = stat
        cpu[int(name)] = ticks
        children.setdefault(ppid, []).append(int(name))
    return children, cpu


def tree_pids(roots, children, cpu):
    seen = set()
    todo = [r for r in roots if r in cpu]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, []))
    return seen


def tree_ticks(roots):
    children, cpu = process_table()
    return sum(cpu[p] for p in tree_pids(roots, children, cpu))


def core_ticks(core):
    with open("/proc/stat") as f:
        for line in f:
            parts = line.split()
            if parts[0] == f"cpu{core}":
                values = [int(v) for v in parts[1:]]
                # user nice system idle iowait irq softirq steal guest guest_nice; guest time
                # is already part of user time, and steal is time the hypervisor ran something
                # else: busy counts only the work this core did.
                busy = values[0] + values[1] + values[2] + values[5] + values[6]
                total = sum(values[:8])
                return busy, total, values[5] + values[6]
    raise SystemExit(f"procstat: no cpu{core} line in /proc/stat")


def main(argv):
    if len(argv) < 2:
        raise SystemExit(__doc__)
    cmd, args = argv[1], argv[2:]
    if cmd == "ports" and len(args) == 1:
        print("\n".join(str(p) for p in free_ports(int(args[0]))))
    elif cmd == "ticks" and args:
        print(tree_ticks([int(a) for a in args]))
    elif cmd == "tree" and args:
        children, cpu = process_table()
        print("\n".join(str(p) for p in sorted(tree_pids([int(a) for a in args], children, cpu))))
    elif cmd == "core" and len(args) == 1:
        print(*core_ticks(int(args[0])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
