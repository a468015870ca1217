"""A node's figures where monitoring tools look: a Prometheus endpoint (`shoal node --metrics ADDR:PORT`, the
exposition format by `prometheus-client`) and a JSON-lines metrics file every node appends (rotated).

The event loop takes one `Sample` of the node per status interval (the numbers the status record already holds,
plus byte counters per channel); the endpoint's thread only reads the newest sample (an immutable object swapped in
whole), so a scrape costs the training nothing but the time to format ~40 numbers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.swarm.net.listen import AddressInUse

log = logging.getLogger(__name__)

PREFIX = "shoal_"
ROLES = ("active", "backup", "broker", "idle", "observer")


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One reading of a node (None: not known yet, or not this node's to know: the loss is the last stage's)."""

    time: float
    peer_id: str
    run_id: str | None = None
    role: str = "idle"
    state: str = "starting"
    stage: int | None = None
    replica: int | None = None
    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    step_seconds: float | None = None  # the last step's wall time in the trainer
    wait_seconds: float | None = None  # of which blocked on the lane's other stages
    samples: int = 0  # sequences this node's lane trained on at its stage (steps x batch)
    peers: int = 0
    bytes: dict[str, list[int]] = field(default_factory=dict)  # channel -> [sent, received]
    compression_ratio: float | None = None
    state_pulls: int = 0  # times this node entered a group with a state pulled from a replica
    refetches: int = 0  # times it re-fetched the majority's state after a vote
    penalties: int = 0  # violations it recorded against peers
    bans: int = 0
    nacks_sent: int = 0  # AQ-SGD: rows this node's link ends asked to be sent again
    nacks_received: int = 0

    def line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def sample_node(node) -> Sample:
    """The node's figures now (on the event loop, which owns everything read here)."""
    fields: dict[str, Any] = getattr(node, "_last_fields", None) or {}
    rt = node.runtime
    sh = node.sh
    channels: dict[str, list[int]] = {}
    if sh is not None:
        channels["control"] = list(sh.control_bytes)
    kw: dict[str, Any] = {}
    if rt is not None:
        replica = rt.replica
        sync, trainer = replica.sync, replica.trainer
        if sync is not None:
            channels["collective"] = [int(sync.bytes_sent), int(sync.bytes_recv)]
        if rt.links is not None:
            channels["lane"] = list(rt.links.bytes())
            nacks = [0, 0]
            for c in rt.links.counters().values():
                nacks[0] += c["sent"].get("nacks", 0)
                nacks[1] += c["recv"].get("nacks", 0)
            kw["nacks_sent"], kw["nacks_received"] = nacks
        table = rt.client.table if rt.client is not None else None
        slot = table.slot_of(node.peer_id) if table is not None else None
        if trainer is not None:
            kw["stage"], kw["replica"] = trainer.stage, trainer.replica
            kw["samples"] = replica.at_step * rt.manifest.batch.batch_size
            last = replica.last
            if last is not None:
                kw["step_seconds"], kw["wait_seconds"] = last.seconds, last.wait_s
        elif slot is not None:
            kw["stage"], kw["replica"] = slot
        kw["state_pulls"] = len(rt.entry.entries) if rt.entry is not None else 0
        kw["refetches"] = rt.consistency.refetches
    return Sample(time=time.time(), peer_id=node.peer_id, run_id=fields.get("run_id"), role=fields.get("role") or
                  node.role, state=fields.get("state") or node.state, step=fields.get("step") or 0,
                  loss=fields.get("loss"), eval_loss=fields.get("eval_loss"), tokens_per_s=fields.get("tokens_per_s"),
                  peers=len(node.membership.live_peers()) if node.membership is not None else 0, bytes=channels,
                  compression_ratio=fields.get("compression_ratio"), penalties=node.penalties.total,
                  bans=node.penalties.bans_total, **kw)


class MetricsFile:
    """Appends one JSON line per sample; past `max_bytes` the file moves to `.1` (`.1` to `.2`, ...), `keep` kept."""

    def __init__(self, path: Path, *, max_bytes: int = 16 << 20, keep: int = 3):
        self.path, self.max_bytes, self.keep = Path(path), max_bytes, keep
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, sample: Sample) -> None:
        line = sample.line() + "\n"
        try:
            if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:  # a full disk must not stop the node
            log.warning("metrics file %s: %s", self.path, e)

    def _rotate(self) -> None:
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        last = self.path.with_name(f"{self.path.name}.{self.keep + 1}")
        last.unlink(missing_ok=True)


class MetricsAddressInUse(AddressInUse):
    """The --metrics port is taken (exit status as for --listen's)."""

    def __init__(self, where: str):
        OSError.__init__(self, errno.EADDRINUSE, f"--metrics {where}: address already in use")


class _Collector:
    """Turns the newest sample into metric families at scrape time (prometheus-client's custom collector)."""

    def __init__(self, holder: MetricsEndpoint):
        self.holder = holder

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        s = self.holder.latest
        if s is None:
            return
        labels = {"peer": s.peer_id, "run": (s.run_id or "")[:16]}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, v: float | None):
            if v is not None:
                g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
                g.add_metric(values, float(v))
                yield g

        def counter(name: str, doc: str, v: float):
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(values, float(v))
            yield c

        yield from gauge("step", "optimizer steps this node's stage has done", s.step)
        yield from gauge("loss", "training loss of the last step (the lane's last stage)", s.loss)
        yield from gauge("eval_loss", "held-out loss at the last evaluation (the lane's last stage)", s.eval_loss)
        yield from gauge("tokens_per_second", "tokens trained per second (smoothed)", s.tokens_per_s)
        yield from gauge("step_seconds", "the last step's wall time", s.step_seconds)
        yield from gauge("lane_wait_seconds", "of the last step, time blocked on the lane's other stages",
                         s.wait_seconds)
        yield from gauge("peers", "live peers this node sees", s.peers)
        yield from gauge("compression_ratio", "uncompressed / sent bytes of the synchronizer since the start",
                         s.compression_ratio)
        yield from gauge("stage", "the pipeline stage this node trains", s.stage)
        yield from gauge("replica", "the lane (data-parallel replica) this node trains in", s.replica)
        yield from counter("samples", "sequences trained at this node's stage", s.samples)
        yield from counter("state_pulls", "group entries with a state pulled from a replica", s.state_pulls)
        yield from counter("refetches", "majority states re-fetched after a hash vote", s.refetches)
        yield from counter("penalties", "violations recorded against peers", s.penalties)
        yield from counter("bans", "peers banned", s.bans)
        yield from counter("aq_nacks_sent", "AQ-SGD rows asked to be resent by this node's link ends", s.nacks_sent)
        yield from counter("aq_nacks_received", "AQ-SGD resend requests received", s.nacks_received)
        for direction, i in (("sent", 0), ("received", 1)):
            c = CounterMetricFamily(PREFIX + f"bytes_{direction}", f"payload bytes {direction}, by channel",
                                    labels=[*names, "channel"])
            for channel, pair in sorted(s.bytes.items()):
                c.add_metric([*values, channel], float(pair[i]))
            yield c
        role = GaugeMetricFamily(PREFIX + "role", "1 for this node's role", labels=[*names, "role", "state"])
        role.add_metric([*values, s.role, s.state], 1.0)
        yield role
        info = InfoMetricFamily(PREFIX + "node", "this node", labels=names)
        info.add_metric(values, {"run_id": s.run_id or ""})
        yield info


class MetricsEndpoint:
    """`/metrics` on ADDR:PORT (its own registry: only shoal's figures, no process collectors that would read /proc
    on every scrape). `latest` is replaced whole by the loop and read whole by the server's thread."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import start_http_server

        self.latest: Sample | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        try:
            self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MetricsAddressInUse(f"{host}:{port}") from None
            raise ValueError(f"--metrics {host}:{port}: {e.strerror or e}") from None
        self.host, self.port = host, self.server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def update(self, sample: Sample) -> None:
        self.latest = sample

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if isinstance(self._thread, threading.Thread):
            self._thread.join(timeout=5)


def parse_listen(text: str) -> tuple[str, int]:
    """ADDR:PORT, PORT alone (localhost), or [V6]:PORT; port 0 takes a free one."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"--metrics {text!r}: expected ADDR:PORT (e.g. 127.0.0.1:9400)") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"--metrics {text!r}: port {p} out of range")
    return host, p
