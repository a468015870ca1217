"""`shoal swarm up --listen` is joinable from another machine: a node in a network namespace this test creates (its
own stack, reaching this one only through a veth pair) types exactly the command `swarm up` printed, with no
--run, and trains in the local swarm's run as a new replica."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.bench import netns
from tests.e2e.test_cli_errors import stop

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]
JOIN_LINE = re.compile(r"volunteers join from another machine with: (shoal node --join (\S+))")


def wait(pred, timeout_s: float, what: str, *logs: Path):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    tails = "\n".join(f"--- {p}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                      for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")


def test_a_node_in_another_network_namespace_joins_swarm_up_listen_with_the_printed_command(tmp_path):
    netns.require_root()  # NetnsError (a failure, not a skip) when namespaces cannot be made here
    tag = os.getpid() % 100000
    ns, host_if, ns_if, net = f"shoal23-{tag}", f"s23h{tag}", f"s23n{tag}", f"10.231.{tag % 250}"
    netns.run("ip", "netns", "add", ns)
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        netns.run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        netns.run("ip", "link", "set", ns_if, "netns", ns)
        netns.run("ip", "addr", "add", f"{net}.1/24", "dev", host_if)
        netns.run("ip", "link", "set", host_if, "up")
        netns.run("ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", ns_if)
        netns.run("ip", "-n", ns, "link", "set", ns_if, "up")
        netns.run("ip", "-n", ns, "link", "set", "lo", "up")
        # the namespace reaches this machine's addresses (whichever `swarm up` prints) through the veth
        netns.run("ip", "-n", ns, "route", "add", "default", "via", f"{net}.1")
        home, err = tmp_path / "home", tmp_path / "up.err"
        with open(err, "w") as f:
            procs.append(subprocess.Popen(
                [*SHOAL, "swarm", "up", "--nodes", "2", "--backups", "0", "--listen", "/ip4/0.0.0.0/tcp/0",
                 "--duration", "300", "--dir", str(tmp_path / "swarm")],
                stdout=subprocess.DEVNULL, stderr=f, env={**env, "SHOAL_HOME": str(home)}))
        line = wait(lambda: JOIN_LINE.search(err.read_text()), 120, "swarm up's join command", err)
        command, addr = line.group(1), line.group(2)
        assert not addr.startswith("/ip4/127.") and "/p2p/12D3KooW" in addr
        status = subprocess.run([*SHOAL, "swarm", "status"], capture_output=True, text=True, timeout=60,
                                env={**env, "SHOAL_HOME": str(home), "COLUMNS": "300"})
        assert command in status.stdout, status.stdout  # swarm status prints the same command
        vjson, vout = tmp_path / "v.json", tmp_path / "v.out"
        with open(vout, "w") as f:  # the volunteer types the printed command (plus where it keeps its files)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, *command.replace("shoal ", f"{sys.executable} -m shoal.node.cli ",
                                                             1).split(),
                 "--identity", str(tmp_path / "v.key"), "--status-file", str(vjson), "--threads", "1"],
                stdout=f, stderr=subprocess.STDOUT, env={**env, "SHOAL_HOME": str(tmp_path / "vhome")}))

        def trained() -> dict | None:
            try:
                doc = json.loads(vjson.read_text())
            except (OSError, ValueError):
                return None
            return doc if doc.get("slot") and (doc.get("samples_done") or 0) > 0 else None

        doc = wait(trained, 180, "the volunteer in the namespace to train", vout, err)
        assert doc["slot"] == "s0r2" and doc["role"] == "active"  # a new replica: the run grew from 2 to 3
        assert all(a.startswith(f"/ip4/{net}.2/") or a.startswith("/ip4/127.") for a in doc["addrs"])
        assert "the swarm's only open run" in vout.read_text()
    finally:
        for p in reversed(procs):
            stop(p)
        netns.run("ip", "netns", "del", ns, check=False)  # its end of the veth pair goes with it
