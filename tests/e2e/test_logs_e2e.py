"""A node's log at the default level grows by less than 20 KB per hour of steady training: a 3-minute local swarm
(`shoal swarm up`), its node logs' sizes taken once training is steady and again before the swarm stops. What used to
fill them (py-libp2p's repeated warnings: failed DHT stores, gossip rate limits, Kademlia protocol errors) is kept to
a quota; nothing logs a traceback at shutdown; a `shoal peers --local` meanwhile logs next to nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]
DURATION_S = 180
STEADY_AFTER_S = 60  # start-up (probing, joining, the first rounds, the first evaluation) is over by then
TARGET_BYTES_PER_HOUR = 20_000


def sizes(workdir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(workdir.glob("node*.log"))}


def test_a_nodes_log_grows_less_than_20_kb_an_hour_of_steady_training(tmp_path):
    home, workdir = tmp_path / "home", tmp_path / "w"
    env = {**os.environ, "SHOAL_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([*SHOAL, "swarm", "up", "--nodes", "4", "--duration", str(DURATION_S), "--json", "--dir",
                             str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        while time.monotonic() - t0 < STEADY_AFTER_S and proc.poll() is None:
            time.sleep(1)
        first, t1 = sizes(workdir), time.monotonic()
        peers = subprocess.run([*SHOAL, "peers", "--local", "--json"], capture_output=True, text=True, timeout=60,
                               env=env)
        assert peers.returncode == 0 and peers.stderr == "", peers.stderr
        while time.monotonic() - t0 < DURATION_S - 5 and proc.poll() is None:
            time.sleep(1)
        last, t2 = sizes(workdir), time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["run"]["steps"] > 20, doc["run"]  # it trained all along
    hours = (t2 - t1) / 3600
    growth = {name: (last[name] - first[name]) / hours for name in first}
    print(f"log growth over {t2 - t1:.0f} s of steady training, bytes per hour: {growth}; sizes at the end: {last}")
    assert all(g < TARGET_BYTES_PER_HOUR for g in growth.values()), growth
    peers_log = home / "logs" / "peers.log"
    assert not peers_log.exists() or peers_log.stat().st_size < 3_000, peers_log.read_text()[-2000:]
    for log in workdir.glob("node*.log"):
        text = log.read_text()
        assert "Traceback" not in text and "LifecycleError" not in text, text[-3000:]
        assert len(re.findall(r"protocols? not supported", text)) <= 6, log
