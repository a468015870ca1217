"""`shoal swarm up --listen` is joinable from another machine: a node in a network namespace this test creates (its
own stack, reaching this one only through a veth pair) types exactly the command `swarm up` printed, with no
--run, and trains in the local swarm's run as a new replica: the run's global batch is now split three ways, so each
of the first two replicas computes less of every step (the volunteer adds throughput), and all three hold the same
state."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.bench import netns
from tests.e2e.test_cli_errors import stop, wait_for

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]
JOIN_LINE = re.compile(r"volunteers join from another machine with: (shoal node --join (\S+))")


def wait(pred, timeout_s: float, what: str, *logs: Path):
    """wait_for, and on a timeout the last lines of `logs`."""
    try:
        return wait_for(pred, timeout_s, what)
    except AssertionError as e:
        tails = "\n".join(f"--- {p}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                          for p in logs if p.exists())
        raise AssertionError(f"{e}\n{tails}") from None


def recent(path: Path, key: str) -> dict[int, object]:
    """A status file's per-step map (`recent_samples`, `recent_hashes`), by step; empty while unreadable."""
    try:
        return {int(k): v for k, v in (json.loads(path.read_text()).get(key) or {}).items()}
    except (OSError, ValueError):
        return {}


def common_step(paths: list[Path], key: str = "recent_samples") -> tuple[int, list] | None:
    """The latest step every one of `paths` has in its `key` map, and their values there (None: no such step)."""
    got = [recent(p, key) for p in paths]
    common = set.intersection(*(set(g) for g in got))
    return (max(common), [g[max(common)] for g in got]) if common else None


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
        files = [tmp_path / "swarm" / f"node{i}.json" for i in range(2)]
        global_batch = 32  # swarm up's run: 16 sequences per starting replica
        step, shares = wait(lambda: common_step(files), 120, "a step of the two replicas", err)
        assert sum(shares) == global_batch and min(shares) > 0, (step, shares)  # two replicas carry every step
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
        # from the step the volunteer computed, the batch is split three ways: every sequence of the step computed
        # once, and each first replica's share smaller than before (the volunteer's is work they no longer do)
        lanes = [*files, vjson]
        step, shares = wait(lambda: common_step(lanes), 60, "a step computed by all three replicas", vout, err)
        assert sum(shares) == global_batch and min(shares) > 0, (step, shares)
        assert shares[0] + shares[1] < global_batch  # the first two no longer compute the whole batch
        step, hashes = wait(lambda: common_step(lanes, "recent_hashes"), 60, "the three replicas' state hashes",
                            vout, err)
        assert len(set(hashes)) == 1, (step, hashes)
    finally:
        for p in reversed(procs):
            stop(p)
        netns.run("ip", "netns", "del", ns, check=False)  # its end of the veth pair goes with it
