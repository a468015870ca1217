"""`shoal node --metrics` scraped by a real Prometheus server (Debian's `prometheus`, which .ci/run installs): the
server's query API returns the node's loss series, and the node's metrics file holds the same figures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.test_cli_errors import stop

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def prometheus_binary() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("this test needs a Prometheus server: `apt-get install prometheus` (Debian's package; .ci/run "
                    "installs it)")
    return exe


def test_prometheus_scrapes_a_training_node_and_returns_its_loss_series(tmp_path):
    exe = prometheus_binary()
    env = {**os.environ, "SHOAL_HOME": str(tmp_path / "home")}
    run = tmp_path / "run.toml"
    subprocess.run([sys.executable, "-m", "shoal.node.cli", "run", "create", "--steps", "2000", "--eval-every", "5",
                    "-o", str(run)], check=True, env=env, capture_output=True, cwd=REPO, timeout=120)
    mport, pport = free_port(), free_port()
    metrics_file = tmp_path / "node.metrics.jsonl"
    node_out, prom_log = tmp_path / "node.out", tmp_path / "prometheus.log"
    with open(node_out, "w") as out:
        node = subprocess.Popen([sys.executable, "-m", "shoal.node.cli", "node", "--listen", "/ip4/127.0.0.1/tcp/0",
                                 "--run", str(run), "--metrics", f"127.0.0.1:{mport}", "--metrics-file",
                                 str(metrics_file), "--status-interval", "0.5", "--print-every", "0"],
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: shoal\n    static_configs:\n      - targets: ['127.0.0.1:{mport}']\n")
    with open(prom_log, "w") as log:
        prom = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{pport}"], stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{pport}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while True:  # the server is up
            if prom.poll() is not None:
                pytest.fail(f"prometheus exited with {prom.returncode}: {prom_log.read_text()[-2000:]}")
            try:
                get_json(f"{base}/status/buildinfo")
                break
            except OSError:
                assert time.monotonic() < deadline, "prometheus did not answer within 60 s"
                time.sleep(0.5)
        values: list[tuple[float, str]] = []
        deadline = time.monotonic() + 240
        while len(values) < 5:  # several scrapes of a training node's loss
            assert node.poll() is None, node_out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no loss series after 240 s: {values}"
            time.sleep(1)
            q = urllib.parse.urlencode({"query": "shoal_loss[5m]"})
            res = get_json(f"{base}/query?{q}")
            assert res["status"] == "success"
            values = [tuple(v) for r in res["data"]["result"] for v in r["values"]]
        series = res["data"]["result"][0]
        assert series["metric"]["job"] == "shoal" and series["metric"]["peer"]
        losses = [float(v) for _, v in values]
        assert all(0 < x < 10 for x in losses)
        up = get_json(f"{base}/query?{urllib.parse.urlencode({'query': 'up'})}")["data"]["result"]
        assert up and up[0]["value"][1] == "1"
        steps = get_json(f"{base}/query?{urllib.parse.urlencode({'query': 'shoal_step'})}")["data"]["result"]
        assert float(steps[0]["value"][1]) >= 1
        sent = get_json(f"{base}/query?{urllib.parse.urlencode({'query': 'shoal_bytes_sent_total'})}")["data"]["result"]
        assert {r["metric"]["channel"] for r in sent} >= {"control", "collective"}
        # the metrics file holds the same figures, one JSON line per status interval
        lines = [json.loads(x) for x in metrics_file.read_text().splitlines()]
        file_losses = {round(x["loss"], 6) for x in lines if x["loss"] is not None}
        assert {round(x, 6) for x in losses} & file_losses
        assert lines[-1]["peer_id"] == series["metric"]["peer"]
    finally:
        stop(prom)
        stop(node)
