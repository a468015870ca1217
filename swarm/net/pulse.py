"""This process's own pulse: notices that its event loop stood still (SIGSTOP, a suspended laptop, a long pause), so
that silence measured across its own freeze is never blamed on its peers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

log = logging.getLogger(__name__)


def steady_clock() -> float:
    """Monotonic seconds that keep counting while the machine is suspended (Linux CLOCK_BOOTTIME; elsewhere
    time.monotonic), so a laptop lid reads as the long freeze it was."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


@dataclass(frozen=True, kw_only=True, slots=True)
class PulseConfig:
    tick_s: float = 0.25  # the loop notes its progress this often
    freeze_after_s: float = 2.0  # no progress for this long: this process was frozen (or starved), not its peers

    def __post_init__(self) -> None:
        if not 0 < self.tick_s < self.freeze_after_s:
            raise ValueError("need 0 < tick_s < freeze_after_s")


class Pulse:
    """Owned by the event loop. `run` ticks; whoever is about to act on a peer's silence measures it with
    `silent_s(last_heard)`, which counts only from the end of this process's last freeze (the silence timers are
    reset by a freeze, never advanced by it). Checks happen on read too, so the order in which tasks wake after a
    freeze does not matter."""

    def __init__(self, clock: Callable[[], float] = steady_clock, config: PulseConfig = PulseConfig()):
        self.clock = clock
        self.config = config
        self.last_tick = clock()
        self.resumed_at = float("-inf")  # clock time at which the last freeze was noticed
        self.freezes: list[tuple[float, float]] = []  # (resumed at, seconds frozen), newest last, a few kept
        self.stopped = False  # `run` ended: the node is gone, and nothing of it measures silence any more

    def check(self) -> float:
        """Note progress now; return how long the loop had stood still if that was a freeze (else 0)."""
        now = self.clock()
        gap = now - self.last_tick
        self.last_tick = now
        if gap <= self.config.freeze_after_s or self.stopped:
            return 0.0
        self.resumed_at = now
        self.freezes = (self.freezes + [(now, gap)])[-16:]
        log.warning("this process stood still for %.1f s: silence timers restart now", gap)
        return gap

    def silent_s(self, last_heard: float) -> float:
        """Seconds of silence since `last_heard` (clock time), counted from the end of our own last freeze."""
        self.check()
        return self.clock() - max(last_heard, self.resumed_at)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Tick until cancelled. The time before the first tick is the node's start (opening its host, checking its
        identity: seconds), not a freeze; after the last, a thread the node left finishing its step may still read
        the pulse, and the node's end is no freeze either."""
        self.last_tick = self.clock()
        task_status.started()
        try:
            while True:
                self.check()
                await trio.sleep(self.config.tick_s)
        finally:
            self.stopped = True
