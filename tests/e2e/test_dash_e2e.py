"""`shoal dash` end to end: a real 3-node swarm, the dashboard under tmux, a node killed. Needs tmux (.ci/run installs
it); without it the test fails with the reason, it never skips."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from shoal.node.localswarm import LocalSwarm, LocalSwarmConfig
from tests.helpers.processes import alive, children

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_tmux():
    assert shutil.which("tmux") is not None, "the dashboard test needs tmux (apt-get install tmux)"


def short(peer_id: str) -> str:
    return peer_id[8:16]  # what the peers table shows


def screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def wait_screen(session: str, pred, timeout_s: float, what: str) -> str:
    t0 = time.monotonic()
    text = ""
    while time.monotonic() - t0 < timeout_s:
        text = screen(session)
        if pred(text):
            return text
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; screen:\n{text}")


def row_of(text: str, peer: str) -> str:
    return next((line for line in text.splitlines() if short(peer) in line), "")


def test_dashboard_shows_a_live_swarm_and_a_killed_node_going(tmp_path):
    s = LocalSwarm(LocalSwarmConfig(nodes=3, workdir=tmp_path / "w", home=tmp_path / "h",
                                    status_interval_s=0.5, gone_after_s=4.0))
    session = f"shoal-dash-{os.getpid()}"
    try:
        s.start()
        s.wait_converged(60)
        ids = s.peer_ids()
        cmd = (f"env SHOAL_HOME={tmp_path / 'h'} {sys.executable} -m shoal.node.cli dash "
               f"--join {s.bootstrap_addrs()[0]} --stale-after 2 --gone-after 4")
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "30", cmd], check=True)
        wait_screen(session, lambda t: "shoal dash" in t, 30, "the dashboard to start")
        subprocess.run(["tmux", "send-keys", "-t", session, "2"], check=True)  # the peers tab
        wait_screen(session, lambda t: all(short(p) in t for p in ids.values()), 45, "all three peers")
        s.nodes[2].proc.send_signal(signal.SIGKILL)
        s.nodes[2].proc.wait()
        text = wait_screen(session, lambda t: "gone" in row_of(t, ids[2]), 30, "the killed node shown gone")
        for i in (0, 1):
            assert "gone" not in row_of(text, ids[i]) and "stale" not in row_of(text, ids[i])
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15 and session in subprocess.run(
                ["tmux", "list-sessions", "-F", "#S"], capture_output=True, text=True).stdout:
            time.sleep(0.2)
        assert session not in subprocess.run(["tmux", "list-sessions", "-F", "#S"], capture_output=True,
                                             text=True).stdout, "q should quit the dashboard"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        s.stop()


def test_a_killed_swarm_up_closes_its_dashboard_and_gives_the_terminal_back(tmp_path):
    """`swarm up --dash` in a shell, its supervisor killed with SIGKILL (it can stop nothing): the dashboard closes
    by itself at once, restores the terminal (no full screen left, no traceback: the shell's prompt works), and the
    nodes leave by themselves."""
    import json

    home = tmp_path / "h"
    session = f"shoal-orphan-{os.getpid()}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "30",
                    "env", "-i", f"PATH={os.environ['PATH']}", f"SHOAL_HOME={home}", "PS1=READY$ ", "TERM=xterm",
                    "bash", "--norc", "--noprofile"], check=True)
    try:
        subprocess.run(["tmux", "send-keys", "-t", session,
                        f"{sys.executable} -m shoal.node.cli swarm up --dash --no-train --nodes 2 --dir {tmp_path / 'w'}",
                        "Enter"], check=True)
        wait_screen(session, lambda t: "shoal dash" in t and "2 peers" in t, 120, "the dashboard on the swarm")
        doc = json.loads((home / "local-swarm.json").read_text())
        supervisor, nodes = doc["pid"], [n["pid"] for n in doc["nodes"]]
        dash = [p for p in children(supervisor) if p not in nodes]
        ui = [c for p in dash for c in children(p)]
        assert len(dash) == 1 and len(ui) == 1, (dash, ui)
        os.kill(supervisor, signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and any(alive(p) for p in dash + ui):
            time.sleep(0.1)
        assert not any(alive(p) for p in dash + ui), "the dashboard outlived its supervisor"
        closed_s = time.monotonic() - t0
        subprocess.run(["tmux", "send-keys", "-t", session, "echo terminal-$((20+22))", "Enter"], check=True)
        text = wait_screen(session, lambda t: "terminal-42" in t, 10, "the shell to answer")
        alternate = subprocess.run(["tmux", "display", "-p", "-t", session, "#{alternate_on}"], capture_output=True,
                                   text=True).stdout.strip()
        assert alternate == "0", "the dashboard left the terminal in its full screen"
        assert "Traceback" not in text, text
        while time.monotonic() - t0 < 20 and any(alive(p) for p in nodes):
            time.sleep(0.1)
        assert not any(alive(p) for p in nodes), "nodes outlived their supervisor"
        print(f"dashboard closed {closed_s:.1f} s and nodes gone {time.monotonic() - t0:.1f} s after the SIGKILL")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
