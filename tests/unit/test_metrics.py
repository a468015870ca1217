"""The metrics endpoint and file: the exposition format parsed back, rotation, the listen address."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.node.metrics import MetricsAddressInUse, MetricsEndpoint, MetricsFile, Sample, parse_listen


def sample(step: int, loss: float | None = 2.5) -> Sample:
    return Sample(time=1.0, peer_id="12D3KooWtest", run_id="ab" * 32, role="active", state="training", stage=1,
                  replica=0, step=step, loss=loss, eval_loss=None, tokens_per_s=123.4, samples=step * 16,
                  bytes={"collective": [10, 20], "lane": [300, 400], "control": [5, 6]}, nacks_sent=2)


def test_the_endpoint_serves_the_newest_sample_in_the_exposition_format():
    ep = MetricsEndpoint("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{ep.port}/metrics"
        assert urllib.request.urlopen(url, timeout=5).read() == b""  # nothing before the first sample
        ep.update(sample(7))
        ep.update(sample(8, loss=2.25))
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert fams["shoal_step"].samples[0].value == 8 and fams["shoal_loss"].samples[0].value == 2.25
        assert "shoal_eval_loss" not in fams  # not known yet: absent, not 0
        sent = {s.labels["channel"]: s.value for s in fams["shoal_bytes_sent"].samples}
        assert sent == {"collective": 10, "lane": 300, "control": 5}
        assert fams["shoal_aq_nacks_sent"].samples[0].value == 2
        assert fams["shoal_role"].samples[0].labels["role"] == "active"
        with pytest.raises(MetricsAddressInUse, match=f"--metrics 127.0.0.1:{ep.port}: address already in use"):
            MetricsEndpoint("127.0.0.1", ep.port)
    finally:
        ep.close()


def test_the_metrics_file_appends_json_lines_and_rotates(tmp_path):
    f = MetricsFile(tmp_path / "m.jsonl", max_bytes=2000, keep=2)
    for i in range(40):
        f.append(sample(i))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["m.jsonl", "m.jsonl.1", "m.jsonl.2"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    last = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    older = [json.loads(x) for x in (tmp_path / "m.jsonl.1").read_text().splitlines()]
    assert last[-1]["step"] == 39 and older[-1]["step"] == last[0]["step"] - 1  # nothing lost between files


def test_listen_addresses():
    assert parse_listen("9400") == ("127.0.0.1", 9400)
    assert parse_listen("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_listen("[::1]:9400") == ("::1", 9400)
    with pytest.raises(ValueError, match="ADDR:PORT"):
        parse_listen("localhost:http")
