"""Another live node with this node's identity in the swarm: the one that joins second refuses to start.

A key file copied to a second machine (or a second path) is not caught by the local lock. Before a node joins
under its identity, it looks at the swarm under a throwaway one (an observer): connecting as a second holder of a
peer id would disturb the first one's connections. If the joined peers list this peer id, the node watches for a
few status periods: a status record that moves on is another process signing with this key right now. A node that
ran with this identity before and died sends nothing new, so a restart is not refused (it only waits that long)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from shoal.swarm.net.membership import Membership

log = logging.getLogger(__name__)
WATCH_PERIODS = 2.5  # gossip periods of an unchanged status to watch a listed identity for a record that moves on
MIN_WATCH_S, MAX_WATCH_S = 3.0, 12.0
SIGNED_SINCE_SLACK_S = 1.0  # clock skew allowed between a twin elsewhere and this machine


class TwinDetected(RuntimeError):
    """Another live node in the swarm holds this node's identity."""


def listed_seq(membership: Membership, peer_id: str) -> int | None:
    """The newest status sequence number the view holds for `peer_id` while it counts as live (None: not listed)."""
    e = membership.peers.get(peer_id)
    if e is None or not e.live or e.status_record is None:
        return None
    return e.status_record.seq


def listed_time(membership: Membership, peer_id: str) -> float:
    """The signing time of the newest status record the view holds for `peer_id` (0 when none)."""
    e = membership.peers.get(peer_id)
    return 0.0 if e is None or e.status_record is None else e.status_record.time


def watch_s(gossip_period_s: float) -> float:
    return min(max(WATCH_PERIODS * gossip_period_s, MIN_WATCH_S), MAX_WATCH_S)


async def refuse_twin(join: list[str], peer_id: str, *, gossip_period_s: float, rpc_timeout_s: float,
                      on_check: Callable[[], None] = lambda: None) -> None:
    """Raise TwinDetected when a live node in the swarm reachable through `join` holds `peer_id`; JoinError when
    no join address answers. `on_check` is called when the identity is listed and the watch begins."""
    from shoal.swarm.net.observer import Observer

    obs = Observer(join, rpc_timeout_s=rpc_timeout_s)
    twin = False
    async with trio.open_nursery() as nursery:
        await nursery.start(obs.run)
        first = listed_seq(obs.membership, peer_id)
        if first is not None:
            on_check()
            # a record signed before the watch began may be this identity's last run arriving late (a node restarted
            # right after it left or was killed): only a newer record signed since then shows a live twin
            since = time.time() - SIGNED_SINCE_SLACK_S
            with trio.move_on_after(watch_s(gossip_period_s)):
                while not twin:
                    await trio.sleep(0.2)
                    now = listed_seq(obs.membership, peer_id)
                    twin = now is not None and now > first and listed_time(obs.membership, peer_id) >= since
            log.info("identity %s listed by the swarm; %s", peer_id, "live elsewhere" if twin else "not live")
        nursery.cancel_scope.cancel()
    if twin:
        raise TwinDetected(f"another node in the swarm runs with this identity ({peer_id}): two nodes must not "
                           f"share a key")
