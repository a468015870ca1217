"""Short, bounded active probes of a link, where no traffic measures it (docs/placement.md, "Measured links").

One probe is one stream: three pings (the round trip: the smallest of three), then N bytes up and, after the
other end's acknowledgement, M bytes back. The prober takes up = 8N / (t_ack - rtt) and down = 8M / (time from the
acknowledgement to the last byte back); the other end records its own views (the N bytes it received; its write of
the M bytes back, an upper bound), and each end publishes only what it measured itself. The serving end bounds everything: bytes per direction, messages per
stream, one probe per peer per `min_interval_s`, a few at once; a peer that probes more often is refused and
penalized. `LinkProber` probes the run's peers whose figures are missing or old, one at a time, a probe every
`interval_s` at most, with sizes adapted to the link (a fast transfer doubles the next one, a slow one halves it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.wire import expect_map, get_field, pack, unpack
from shoal.swarm.net.framing import (BufferedReader, StreamClosed, close_quietly, exchange_failures, frame,
                                     read_length)
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.linkmeter import LinkMeter
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

PROBE_PROTOCOL = "/shoal/linkprobe/1.0.0"
MAX_PROBE_BYTES = 1 << 20  # per direction
MAX_MESSAGES = 8  # per probe stream
MAX_HEADER_BYTES = 256
PINGS = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    interval_s: float = 10.0  # one probe at most this often
    refresh_s: float = 300.0  # a peer whose figures are older than this is probed again
    timeout_s: float = 15.0  # one probe
    min_bytes: int = 64 * 1024
    max_bytes: int = 1 << 20
    start_bytes: int = 256 * 1024
    target_s: tuple[float, float] = (0.05, 1.0)  # a transfer faster than this doubles the next size, slower halves
    min_interval_s: float = 4.0  # serving: one probe per peer this often at most
    max_concurrent: int = 2  # serving: probes at once
    backoff_s: float = 60.0  # a peer whose probe failed is left alone this long

    def __post_init__(self) -> None:
        if not 0 < self.min_bytes <= self.start_bytes <= self.max_bytes <= MAX_PROBE_BYTES:
            raise ValueError(f"need 0 < min_bytes <= start_bytes <= max_bytes <= {MAX_PROBE_BYTES}")
        if min(self.interval_s, self.refresh_s, self.timeout_s, self.backoff_s) <= 0 or self.max_concurrent < 1:
            raise ValueError("positive intervals and max_concurrent >= 1 are required")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    rtt_s: float
    up_bps: float
    down_bps: float
    seconds: float  # the whole probe


class ProbeError(RuntimeError):
    """A probe failed: the peer refused, went away, answered garbage or took too long."""


class LinkProbeServer:
    """Answers probes; measures the bytes it receives into `meter` (see the module)."""

    def __init__(self, sh: SwarmHost, penalties: Penalties, meter: LinkMeter, config: ProbeConfig = ProbeConfig(),
                 clock: Callable[[], float] = time.monotonic):
        self.sh, self.penalties, self.meter, self.config, self.clock = sh, penalties, meter, config, clock
        self._last: dict[str, float] = {}
        self._active = 0
        self.refused = 0
        sh.set_handler(PROBE_PROTOCOL, self._serve)

    def _admit(self, peer: str) -> str | None:
        """Why a probe from `peer` is refused now (None: it is served)."""
        if self.penalties.is_banned(peer):
            return "banned"
        now = self.clock()
        if now - self._last.get(peer, -1e18) < self.config.min_interval_s:
            return f"probes more often than every {self.config.min_interval_s:g} s"
        if self._active >= self.config.max_concurrent:
            return "busy"
        if len(self._last) > 4096:
            self._last = {p: t for p, t in self._last.items() if now - t < self.config.min_interval_s}
        self._last[peer] = now
        return None

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        why = self._admit(peer)
        if why is not None:
            self.refused += 1
            if why != "busy":
                self.penalties.penalize(peer, f"link probe: {why}")
            await _reset(stream)
            return
        self._active += 1
        try:
            with trio.fail_after(self.config.timeout_s):
                await self._answer(stream, peer)
        except (ProtocolError, trio.TooSlowError) as e:
            self.penalties.penalize(peer, f"link probe: {type(e).__name__}: {e}")
            await _reset(stream)
        except StreamClosed:
            pass
        finally:
            self._active -= 1
        await close_quietly(stream)

    async def _answer(self, stream, peer: str) -> None:
        reader = BufferedReader(stream)
        for _ in range(MAX_MESSAGES):
            try:
                n = await read_length(stream, MAX_HEADER_BYTES, reader)
            except StreamClosed:
                return  # the prober is done
            head = expect_map(unpack(await reader.read(n), max_bytes=MAX_HEADER_BYTES), "probe header")
            op = get_field(head, "op", str)
            if op == "ping":
                await stream.write(frame(b"pong"))
            elif op == "bulk":
                up, back = get_field(head, "n", int), get_field(head, "back", int)
                if not (0 < up <= MAX_PROBE_BYTES and 0 <= back <= MAX_PROBE_BYTES):
                    raise ProtocolError(f"probe of {up} bytes up, {back} back: outside 1..{MAX_PROBE_BYTES}")
                t0 = self.clock()
                await reader.read(up)
                self.meter.received(peer, up, self.clock() - t0)
                t0 = self.clock()
                await stream.write(frame(pack({"got": up})) + bytes(back))
                # a sender's own timing (the write may end before the bytes arrive: an upper bound, which the link
                # book caps by the prober's view of what it received)
                self.meter.sent(peer, back, self.clock() - t0)
            else:
                raise ProtocolError(f"unknown probe op {op[:20]!r}")


async def probe(sh: SwarmHost, peer: str, nbytes: int, meter: LinkMeter, *, timeout_s: float = 15.0,
                clock: Callable[[], float] = time.monotonic) -> ProbeResult:
    """Probe the link to `peer` with `nbytes` each way; record the figures in `meter`. Raises ProbeError."""
    if not 0 < nbytes <= MAX_PROBE_BYTES:
        raise ValueError(f"nbytes must be in 1..{MAX_PROBE_BYTES}")
    start = clock()
    with exchange_failures(ProbeError, f"probe of {peer[:16]}…", timeout_s):
        await sh.prepare_path(peer)
        stream = await sh.open_stream(peer, PROBE_PROTOCOL, bulk=True)
        try:
            reader = BufferedReader(stream)
            rtts = []
            for _ in range(PINGS):
                t0 = clock()
                await stream.write(frame(pack({"op": "ping"})))
                if await reader.read(await read_length(stream, MAX_HEADER_BYTES, reader)) != b"pong":
                    raise ProbeError("bad pong")
                rtts.append(clock() - t0)
            rtt = min(rtts)
            t0 = clock()
            await stream.write(frame(pack({"op": "bulk", "n": nbytes, "back": nbytes})) + bytes(nbytes))
            ack = expect_map(unpack(await reader.read(await read_length(stream, MAX_HEADER_BYTES, reader)),
                                    max_bytes=MAX_HEADER_BYTES), "probe ack")
            t_ack = clock()
            if get_field(ack, "got", int) != nbytes:
                raise ProbeError("the peer acknowledged another size")
            await reader.read(nbytes)
            t_end = clock()
        finally:
            await close_quietly(stream)
    # the bytes up took the ack's time less one round trip (at least a tenth of it: a link too fast to tell)
    up_s = max(t_ack - t0 - rtt, (t_ack - t0) / 10)
    down_s = max(t_end - t_ack, 1e-6)
    result = ProbeResult(rtt_s=rtt, up_bps=8 * nbytes / up_s, down_bps=8 * nbytes / down_s, seconds=t_end - start)
    meter.rtt(peer, rtt)
    meter.sent(peer, nbytes, up_s)
    meter.received(peer, nbytes, down_s)
    return result


class LinkProber:
    """Probes, one at a time, the candidates whose figures are missing, incomplete or older than `refresh_s`: the
    least recently measured first (see the module)."""

    def __init__(self, sh: SwarmHost, meter: LinkMeter, candidates: Callable[[], list[str]],
                 config: ProbeConfig = ProbeConfig(), clock: Callable[[], float] = time.monotonic):
        self.sh, self.meter, self.candidates, self.config, self.clock = sh, meter, candidates, config, clock
        self._size: dict[str, int] = {}
        self._failed: dict[str, float] = {}
        self.probes = 0
        self.failures = 0

    def next_target(self) -> str | None:
        now = self.clock()
        due = [p for p in dict.fromkeys(self.candidates()) if p != self.sh.peer_id
               and now - self._failed.get(p, -1e18) >= self.config.backoff_s
               and (not self.meter.complete(p) or self.meter.age_s(p) > self.config.refresh_s)]
        return max(due, key=lambda p: (self.meter.age_s(p), p), default=None)

    async def probe_once(self) -> ProbeResult | None:
        peer = self.next_target()
        if peer is None:
            return None
        size = self._size.get(peer, self.config.start_bytes)
        self.probes += 1
        try:
            r = await probe(self.sh, peer, size, self.meter, timeout_s=self.config.timeout_s, clock=self.clock)
        except ProbeError as e:
            self.failures += 1
            self._failed[peer] = self.clock()
            log.info("link probe to %s failed: %s", peer, e)
            return None
        slowest = max(8 * size / r.up_bps, 8 * size / r.down_bps)
        lo, hi = self.config.target_s
        if slowest < lo:
            size = min(self.config.max_bytes, 2 * size)
        elif slowest > hi:
            size = max(self.config.min_bytes, size // 2)
        self._size[peer] = size
        return r

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.config.interval_s)
            await self.probe_once()


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:  # noqa: BLE001
        pass
