"""A small recorded swarm for the dashboard tests: joins, training, a failure and a promotion, a leave.

Deterministic: fixed peer ids, fixed times from T0, no randomness. `SCENARIO` is a time-ordered list of
(local receive time, record); `END` is when the recording stops (A2 is gone by then, A3 has left).
"""

from __future__ import annotations

from shoal.protocol import manifest as mf
from shoal.protocol.records import Announcement, HardwareProfile, LeaveNotice, StatusRecord

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
END = T0 + 44.0
MANIFEST = mf.RunManifest.default("tiny", name="scenario", plan=mf.ParallelPlan(
    replicas=3, sync=mf.SyncSpec(method="cocktail")))  # what the observer fetched (unsigned: the view trusts its feed)

BROKER = "12D3KooWBrokerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
A1 = "12D3KooWActive1BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
A2 = "12D3KooWActive2CCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"
A3 = "12D3KooWActive3DDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDDD"
K1 = "12D3KooWBackup1EEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEEE"
K2 = "12D3KooWBackup2FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF"
RUN = MANIFEST.run_id

HARDWARE = {
    BROKER: HardwareProfile(device_kind="cpu", device_name="EPYC 7443", memory_bytes=64 << 30,
                            matmul_tflops=1.2, free_disk_bytes=500 << 30, cpu_count=24),
    A1: HardwareProfile(device_kind="cuda", device_name="RTX 4090", memory_bytes=24 << 30,
                        matmul_tflops=165.0, free_disk_bytes=900 << 30, cpu_count=16),
    A2: HardwareProfile(device_kind="cuda", device_name="RTX 3090", memory_bytes=24 << 30,
                        matmul_tflops=71.0, free_disk_bytes=200 << 30, cpu_count=12),
    A3: HardwareProfile(device_kind="mps", device_name="Apple M2 Max", memory_bytes=32 << 30,
                        matmul_tflops=13.6, free_disk_bytes=300 << 30, cpu_count=12),
    K1: HardwareProfile(device_kind="cuda", device_name="RTX 3060", memory_bytes=12 << 30,
                        matmul_tflops=25.0, free_disk_bytes=100 << 30, cpu_count=8),
    K2: HardwareProfile(device_kind="cpu", device_name="i7-12700", memory_bytes=32 << 30,
                        matmul_tflops=0.9, free_disk_bytes=50 << 30, cpu_count=20),
}
PORT = {BROKER: 4001, A1: 4002, A2: 4003, A3: 4004, K1: 4005, K2: 4006}


def announcement(pid: str, at: float) -> Announcement:
    return Announcement(peer_id=pid, addrs=(f"/ip4/127.0.0.1/tcp/{PORT[pid]}/p2p/{pid}",), software_version="0.1.0",
                        protocol_version=1, hardware=HARDWARE[pid], started_at=at - 5.0)


def _scenario() -> list[tuple[float, object]]:
    out: list[tuple[float, object]] = [(T0 + 0.1 * i, announcement(pid, T0)) for i, pid in enumerate(HARDWARE)]
    out.append((T0 + 2.0, MANIFEST))
    seq = dict.fromkeys(HARDWARE, 0)

    def status(pid: str, t: float, **kw) -> None:
        seq[pid] += 1
        out.append((t, StatusRecord(peer_id=pid, seq=seq[pid], time=t, run_id=RUN, peers_seen=5, **kw)))

    slots = {A1: "s0r0", A2: "s0r1", A3: "s0r2"}
    speed = {A1: 5200.0, A2: 3100.0, A3: 1400.0, K1: 2400.0}
    for tick in range(21):  # every 2 s for 40 s
        t = T0 + 1.0 + 2.0 * tick
        step = 10 * tick
        loss = round(4.2 * 0.93**tick + 1.1, 4)
        evl = round(loss + 0.08, 4) if tick % 4 == 0 else None
        status(BROKER, t + 0.05, role="broker", state="ready", step=step, up_bytes_per_s=2_000.0,
               down_bytes_per_s=6_000.0, bytes_sent=2_000 * tick, bytes_recv=6_000 * tick)
        trainers = [A1, A3] + ([A2] if tick <= 9 else []) + ([K1] if tick >= 14 else [])
        if tick > 16:
            trainers.remove(A3)  # A3 leaves at tick 17
        for i, pid in enumerate(trainers):
            err = "sync with s0r0 timed out after 30 s" if (pid == A2 and tick == 9) else None
            status(pid, t + 0.1 * (i + 1), role="active", state="training", slot=slots.get(pid, "s0r1"),
                   step=step, loss=round(loss + 0.01 * i, 4), eval_loss=evl, tokens_per_s=speed[pid],
                   up_bytes_per_s=1.25e6, down_bytes_per_s=1.3e6, bytes_sent=int(1.25e6 * 2 * tick),
                   bytes_recv=int(1.3e6 * 2 * tick), compression_ratio=117.0, ratio_now=17.0,
                   state_hash=f"{step:08x}beef", error=err)
        if tick < 14:
            status(K1, t + 0.6, role="backup", state="ready", step=step, up_bytes_per_s=0.0,
                   down_bytes_per_s=4.0e5, warm_stage=0)
        status(K2, t + 0.7, role="backup", state="syncing", step=max(step - 30, 0), down_bytes_per_s=8.0e5,
               warm_stage=0, error="checkpoint pull from s0r0 failed: connection reset" if tick == 3 else None)
        if tick == 17:
            out.append((t + 0.9, LeaveNotice(peer_id=A3, time=t + 0.9, reason="operator pressed Ctrl+C")))
    out.sort(key=lambda x: x[0])
    return out


SCENARIO = _scenario()


class Clock:
    """A hand-set clock: `clock()` returns `clock.t`."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def play(feed, clock: Clock, tick=None, until: float = END) -> None:
    """Feed every record received up to `until`, setting the clock to each one's time; `tick(now)` each second."""
    next_tick = T0
    for t, rec in SCENARIO:
        if t > until:
            break
        while tick is not None and next_tick <= t:
            clock.t = next_tick
            tick(next_tick)
            next_tick += 1.0
        clock.t = t
        feed(rec)
    while tick is not None and next_tick <= until:
        clock.t = next_tick
        tick(next_tick)
        next_tick += 1.0
    clock.t = until
