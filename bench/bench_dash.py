"""CPU use of `shoal dash` (observer process + UI process) while it follows an N-node local swarm.

Run: python bench/bench_dash.py [--nodes 10] [--seconds 60]   (needs tmux; writes bench/results/dash_cpu.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    home = Path(tempfile.mkdtemp(prefix="shoal-dash-bench-"))
    env = {**os.environ, "SHOAL_HOME": str(home)}
    shoal = [sys.executable, "-m", "shoal.node.cli"]
    swarm = subprocess.Popen([*shoal, "swarm", "up", "--nodes", str(args.nodes), "--json",
                              "--duration", str(args.seconds + 120)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    session = f"shoal-dash-bench-{os.getpid()}"
    try:
        t0 = time.monotonic()
        while '"state": "running"' not in ((home / "local-swarm.json").read_text()
                                            if (home / "local-swarm.json").exists() else ""):
            if time.monotonic() - t0 > 120 or swarm.poll() is not None:
                raise SystemExit("the swarm did not start")
            time.sleep(0.5)
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40",
                        f"env SHOAL_HOME={home} {shlex.join(shoal)} dash --local"], check=True)
        time.sleep(3)
        subprocess.run(["tmux", "send-keys", "-t", session, "2"], check=True)  # the peers table, the busiest pane
        time.sleep(7)  # warm-up: imports, first snapshot
        shell = int(subprocess.run(["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"], capture_output=True,
                                   text=True, check=True).stdout.split()[0])
        tree = [shell] + children(shell)
        tree += [c for pid in tree[1:] for c in children(pid)]
        pids = {}
        for pid in tree:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "shoal.tui" in cmd:
                pids["ui (python -m shoal.tui)"] = pid
            elif " dash " in cmd:
                pids["observer (shoal dash)"] = pid
        if len(pids) != 2:
            raise SystemExit(f"could not find both dashboard processes in {tree}")
        before = {k: cpu_s(v) for k, v in pids.items()}
        w0 = time.monotonic()
        time.sleep(args.seconds)
        wall = time.monotonic() - w0
        after = {k: cpu_s(v) for k, v in pids.items()}
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        swarm.send_signal(signal.SIGINT)  # the supervisor stops its nodes by PID
        swarm.wait(timeout=60)
    usage = {k: round((after[k] - before[k]) / wall * 100, 2) for k in pids}
    result = {"command": command, "nodes": args.nodes, "wall_s": round(wall, 1), "cpu_percent_of_one_core": usage,
              "total_cpu_percent": round(sum(usage.values()), 2), "screen": screen}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dash_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"# shoal dash CPU use following a {args.nodes}-node local swarm\n", f"Command: `{command}`\n",
          "| process | CPU (% of one core) |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in usage.items()]
    md += [f"| total | {result['total_cpu_percent']} |", "", f"Over {wall:.0f} s on the peers pane, status every 1 s "
           "from each node; the swarm itself ran on the same 2-core machine.", "", "Screen at the end:", "```",
           screen.rstrip(), "```"]
    (args.out / "dash_cpu.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
