"""A node's log at the default level stays quiet while it trains: the default `shoal swarm up` (four real node
processes on 127.0.0.1: the broker and two more active replicas, and a warm backup) trains for about a minute and a
half (a volunteer's log once reached 267 KB in three minutes: 1,325 gossip rate-limit warnings, several a second, and
library noise). Each node's whole log, start-up, the training and shutdown included, stays under one hour's budget of
20 KB, and after the swarm is stopped no log holds a traceback. What the log may grow by in an hour of steady training
is bounded by the log's own rule (node/cli/logs.py: five records of a kind, then one an hour with a count), so noise
that repeats shows within the first minute; the growth over the last minute is printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli_errors import stop, wait_for

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]
NODES = 4
SETTLE_S = 15.0  # after every replica trains: joins, the backup's first warm copy, the first status exchanges
WINDOW_S = 60.0  # the training window whose growth is printed
MAX_BYTES_PER_HOUR = 20_000  # the budget for an hour of steady training


def step_of(path: Path) -> int | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("step") if doc.get("slot") else None  # a replica (the broker holds one too), not the backup


def test_a_minute_and_a_half_of_training_log_less_than_an_hours_budget_and_no_traceback(tmp_path):
    d = tmp_path / "swarm"
    err = tmp_path / "up.err"
    env = {**os.environ, "SHOAL_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    with open(err, "w") as f:
        proc = subprocess.Popen([*SHOAL, "swarm", "up", "--duration", "600", "--dir", str(d)],
                                stdout=subprocess.DEVNULL, stderr=f, env=env)
    logs = [d / f"node{i}.log" for i in range(NODES)]
    try:
        status = [d / f"node{i}.json" for i in range(NODES)]
        wait_for(lambda: sum((step_of(p) or 0) >= 3 for p in status) == NODES - 1 or proc.poll() is not None, 180,
                 "three active replicas training")
        assert proc.poll() is None, err.read_text()[-3000:]
        time.sleep(SETTLE_S)
        before = [p.stat().st_size for p in logs]
        steps_before = [step_of(p) for p in status]
        time.sleep(WINDOW_S)
        after = [p.stat().st_size for p in logs]
        steps_after = [step_of(p) for p in status]
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        stop(proc)
    rates = [(b - a) / WINDOW_S * 3600 for a, b in zip(before, after)]
    trained = [b - a for a, b in zip(steps_before, steps_after) if a is not None and b is not None]
    print(f"log growth per node over {WINDOW_S:.0f} s of training ({trained} steps by the active ones): "
          f"{[b - a for a, b in zip(before, after)]} bytes, {[round(r) for r in rates]} B/h; "
          f"log sizes at the end {[p.stat().st_size for p in logs]} bytes")
    assert len(trained) == NODES - 1 and min(trained) > 0, (steps_before, steps_after)  # it was training throughout
    big = {p.name: (p.stat().st_size, p.read_bytes()[-3000:].decode(errors="replace")) for p in logs
           if p.stat().st_size >= MAX_BYTES_PER_HOUR}
    assert not big, big
    tracebacks = {p.name: p.read_text(errors="replace").split("Traceback", 1)[1][:1500] for p in logs
                  if "Traceback" in p.read_text(errors="replace")}
    assert not tracebacks, tracebacks
