"""A raw TCP probe that checks each shaped link before a benchmark uses it: bulk transfer, goodput by the receiver.

Upload of node i is measured node -> switch (the bridge's address; nothing but node i's own tbf on the path),
download switch -> node i. The tbf counts Ethernet frames, the receiver counts TCP payload, so the expected
goodput is the rate times the payload share of a full frame (1448 of 1514 bytes).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

from shoal.bench.netns import NetnsError, socket_in
from shoal.bench.topology import Topology

log = logging.getLogger(__name__)

PAYLOAD_SHARE = 1448 / 1514  # TCP payload of a full Ethernet frame (timestamps on)
UNSHAPED_FLOOR_MBIT = 200.0  # an unshaped veth must beat every home rate the scenarios use


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    seconds: float = 1.0  # measured span, after the warm-up
    warmup_s: float = 0.4  # the tbf bucket and TCP slow start are spent in this span, not measured
    tolerance: float = 0.15  # relative: measured goodput within this of the expected one
    io_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.warmup_s < 0 or not 0 < self.tolerance < 1 or self.io_timeout_s <= 0:
            raise ValueError("probe: seconds and io_timeout_s > 0, warmup_s >= 0, tolerance in (0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeResult:
    node: int
    direction: str  # "up" | "down"
    rate_mbit: float | None  # the shaped rate (None: unshaped)
    expected_mbit: float | None  # goodput the rate allows
    measured_mbit: float
    ok: bool

    def to_dict(self) -> dict:
        return asdict(self)


def goodput_mbit(src_ns: str, dst_ns: str, dst_ip: str, config: ProbeConfig) -> float:
    """TCP payload Mbit/s from a socket in `src_ns` to one listening on `dst_ip` in `dst_ns`."""
    srv = socket_in(dst_ns)
    cli = socket_in(src_ns)
    stop = threading.Event()
    try:
        srv.settimeout(config.io_timeout_s)
        srv.bind((dst_ip, 0))
        srv.listen(1)
        cli.settimeout(config.io_timeout_s)
        cli.connect((dst_ip, srv.getsockname()[1]))
        conn, _ = srv.accept()
    except OSError as e:
        srv.close()
        cli.close()
        raise NetnsError(f"probe {src_ns} -> {dst_ns} ({dst_ip}): {e}") from e

    def send() -> None:
        chunk = b"\0" * 65536
        try:
            while not stop.is_set():
                cli.send(chunk)
        except OSError:
            pass  # the receiver closed: done

    sender = threading.Thread(target=send, name="probe-send", daemon=True)
    sender.start()
    buf = bytearray(1 << 18)
    got = 0
    try:
        conn.settimeout(config.io_timeout_s)
        t0 = time.monotonic()
        t_warm, t_end = t0 + config.warmup_s, t0 + config.warmup_s + config.seconds
        start = None
        while (now := time.monotonic()) < t_end:
            n = conn.recv_into(buf)
            if n == 0:
                break
            if now >= t_warm:
                if start is None:
                    start = now
                else:
                    got += n
        span = time.monotonic() - (start or t_end)
    except OSError as e:
        raise NetnsError(f"probe {src_ns} -> {dst_ns}: {e}") from e
    finally:
        stop.set()
        conn.close()
        cli.close()
        srv.close()
        sender.join(config.io_timeout_s)
    return 8 * got / span / 1e6 if span > 0 else 0.0


def _check(node: int, direction: str, rate: float | None, measured: float, config: ProbeConfig) -> ProbeResult:
    if rate is None:
        return ProbeResult(node=node, direction=direction, rate_mbit=None, expected_mbit=None,
                           measured_mbit=round(measured, 2), ok=measured >= UNSHAPED_FLOOR_MBIT)
    expected = rate * PAYLOAD_SHARE
    return ProbeResult(node=node, direction=direction, rate_mbit=rate, expected_mbit=round(expected, 2),
                       measured_mbit=round(measured, 2), ok=abs(measured - expected) <= config.tolerance * expected)


def verify(topo: Topology, config: ProbeConfig = ProbeConfig()) -> list[ProbeResult]:
    """Probe every node's upload, then every node's download, each direction's nodes at once (their links are
    separate); unshaped links one at a time (they are CPU-bound, and would slow each other)."""
    results: list[ProbeResult] = []
    for direction in ("up", "down"):
        jobs = []
        for i, shape in enumerate(topo.shapes):
            rate = shape.up_mbit if direction == "up" else shape.down_mbit
            src, dst, ip = ((topo.node_ns[i], topo.switch, topo.switch_ip) if direction == "up"
                            else (topo.switch, topo.node_ns[i], topo.ip(i)))
            jobs.append((i, rate, src, dst, ip))
        measured: dict[int, float | BaseException] = {}

        def one(i, src, dst, ip) -> None:
            try:
                measured[i] = goodput_mbit(src, dst, ip, config)
            except BaseException as e:  # noqa: BLE001 - reported below
                measured[i] = e

        shaped = [threading.Thread(target=one, args=(i, s, d, ip), daemon=True) for i, r, s, d, ip in jobs if r]
        for t in shaped:
            t.start()
        for t in shaped:
            t.join(config.warmup_s + config.seconds + 3 * config.io_timeout_s)
        for i, rate, src, dst, ip in jobs:
            if rate is None:
                one(i, src, dst, ip)

        def result(i, rate) -> ProbeResult:
            m = measured.get(i)
            if not isinstance(m, float):
                raise NetnsError(f"probe of node {i} {direction}: {m or 'no answer'}")
            return _check(i, direction, rate, m, config)

        for i, rate, src, dst, ip in jobs:
            r = result(i, rate)
            if not r.ok and rate is not None:  # one more try, alone: a probe that shared the CPU can read low
                log.info("probe node %d %s: %.1f Mbit/s (expected %s): measuring again, alone", i, direction,
                         r.measured_mbit, r.expected_mbit)
                one(i, src, dst, ip)
                r = result(i, rate)
            results.append(r)
    for r in results:
        log.info("probe node %d %s: %.1f Mbit/s (expected %s) %s", r.node, r.direction, r.measured_mbit,
                 r.expected_mbit, "ok" if r.ok else "OFF")
    return results
