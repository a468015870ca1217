"""A stage's links to its lane neighbours: one persistent stream per directed link, credit windows, deadlines, byte
counters, and strict checks of everything that arrives (a violation penalizes the sender and aborts only that lane's
step; the node keeps serving everything else).

Stage s dials s+1 for activations (forward) and s-1 for gradients (backward); each stream's receiver sends credits
back on it. Gradient norms are relayed along the lane's own links (a stage forwards what it hears from one side to
the other), so a lane needs no connections beyond its S-1 boundaries and every stage hears every stage's norms after
at most S-1 hops of a few dozen bytes. `Abort` needs no credit, so it passes a full window.

Here: `LinkHub`, the node's service that accepts inbound links and hands them to the open ends. `LinkEnd` (this
stage's side, async, on the event loop) is in end.py and knows the hub only as the `LinkServices` it is given;
config, spec, errors and tensor frames are in spec.py; `BlockingLinkEnd`, an end's calls for the trainer's worker
thread, in blocking.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.lane import LANE_PROTOCOL, MAX_RECORD_BYTES, LinkHello, Refuse, decode_one, encode_message
from shoal.swarm.net.framing import close_quietly, read_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Allowance, Penalties
from shoal.swarm.lane.aq_handover import AQStores
from shoal.swarm.lane.end import LinkEnd, LinkServices
from shoal.swarm.lane.spec import LEN, LaneSpec, Link, LinkConfig, reset_quietly

log = logging.getLogger(__name__)
EARLY_FREE = 50  # dials of a provider not named by any table here refused unpunished within EARLY_WINDOW_S (a
EARLY_WINDOW_S = 60.0  # replacement retries at doubling intervals up to 1 s for open_timeout_s: about 33 in 30 s)


class LinkHub:
    """The node's lane-link service: one handler for LANE_PROTOCOL that hands inbound links to the open LinkEnds.
    Create with `open_link_hub` (its nursery runs the outbound links' credit readers)."""

    def __init__(self, sh: SwarmHost, penalties: Penalties, config: LinkConfig, nursery: trio.Nursery,
                 plan: tuple[str, int, int] | None = None, allow: Callable[[str], bool] | None = None,
                 named: Callable[[str, LinkHello], bool] | None = None):
        self.sh, self.penalties, self.config, self.nursery = sh, penalties, config, nursery
        self.plan = plan  # (run id, stages, lanes) this node trains, known before any end is open
        # whether a table this node follows (in force, or announced for a later step) names the dialer at its end
        # of the hello's link, and this node at the other; None: whoever the hello names
        self.named = named
        self.allow = allow  # the run's providers: one not named (yet) is refused unpunished a few times
        self._early = Allowance(EARLY_FREE, EARLY_WINDOW_S)
        self._inbound: dict[tuple[str, int, int, str], tuple[LinkEnd, Link]] = {}
        self._ends: list[LinkEnd] = []
        self.refused = 0  # honest dials refused because their link was not open here (yet): the dialer retries
        # AQ-SGD stores by link position (they outlive the ends), served to `allow`ed peers (the run's members)
        self.aq_stores = AQStores(sh, penalties, allow=allow)
        self.services = LinkServices(sh=sh, penalties=penalties, config=config, nursery=nursery,
                                     aq_stores=self.aq_stores, forget=self._forget)
        sh.set_handler(LANE_PROTOCOL, self._serve)

    def open(self, spec: LaneSpec) -> LinkEnd:
        """This stage's end of its lane's links; neighbours may dial it from now on (call on the event loop)."""
        end = LinkEnd(self.services, spec)
        keys = [((spec.run_id, link.boundary, spec.lane, link.direction), link) for link in end.links
                if not link.outbound]
        if any(k in self._inbound for k, _ in keys):
            raise ValueError(f"a link of lane {spec.lane} of this run is already open here")
        for k, link in keys:
            self._inbound[k] = (end, link)
        self._ends.append(end)
        return end

    def _forget(self, end: LinkEnd) -> None:
        self._inbound = {k: v for k, v in self._inbound.items() if v[0] is not end}
        self._ends = [e for e in self._ends if e is not end]

    def _plausible(self, hello: LinkHello) -> bool | None:
        """None: this node trains no such run; else whether its boundary and lane exist in the run's plan (a
        neighbour may dial before this node's end of the link is open: it is refused and dials again)."""
        plans = [(e.spec.run_id, e.spec.num_stages, e.spec.replicas) for e in self._ends]
        if self.plan is not None:
            plans.append(self.plan)
        plan = next((p for p in plans if p[0] == hello.run), None)
        if plan is None:
            return None
        return hello.boundary < plan[1] - 1 and hello.lane < plan[2]

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if self.penalties.is_banned(peer):
            await reset_quietly(stream)
            return
        try:
            with trio.fail_after(self.config.dial_timeout_s):
                raw = await read_frame(stream, MAX_RECORD_BYTES)
                hello = decode_one(raw, LinkHello)
        except (ProtocolError, trio.TooSlowError) as e:
            self.penalties.penalize(peer, f"lane link: bad hello: {type(e).__name__}: {e}")
            await reset_quietly(stream)
            return
        except Exception as e:  # noqa: BLE001 - the dialer went away
            log.debug("lane hello from %s: %s: %s", peer, type(e).__name__, e)
            await reset_quietly(stream)
            return
        found = self._inbound.get((hello.run, hello.boundary, hello.lane, hello.direction))
        plausible = self._plausible(hello)
        honest = plausible and hello.peers == (peer, self.sh.peer_id)
        if honest and self.named is not None and not self.named(peer, hello):
            # no table this node follows puts the dialer there: a provider of the run may be named by a table on
            # its way here (refused unpunished a few times, then an offence); anyone else is reset and penalized
            why = "no table of the run names it at that end of the link"
            if self.allow is not None and self.allow(peer) and self._early.take(peer):
                log.info("lane link b%d/%s lane %d from %s refused: %s (yet)", hello.boundary, hello.direction,
                         hello.lane, peer, why)
                await _refuse(stream, "this link is not open to you here (yet)")
            else:
                self.penalties.penalize(peer, f"lane link b{hello.boundary}/{hello.direction} lane {hello.lane}: "
                                              f"{why}")
                await reset_quietly(stream)
            return
        if honest and (found is None or found[1].peer != peer):
            # our end of it is not open (yet), or still open to the neighbour the dialer replaces (a promoted
            # backup may dial before this node has moved to the table that names it): the dialer retries until
            # its dial deadline, no penalty (an honest replacement must not be banned for being early)
            why = "not open here" if found is None else "open here to another peer (yet)"
            log.info("lane link b%d/%s lane %d from %s refused: %s", hello.boundary, hello.direction, hello.lane,
                     peer, why)
            self.refused += 1
            await _refuse(stream, f"this link is {why}")
            return
        if not honest:
            why = ("wrong run" if plausible is None else "unknown lane or boundary" if not plausible
                   else "the hello names other peers than the stream's")
            self.penalties.penalize(peer, f"lane link: hello for run {hello.run[:16]} b{hello.boundary}/"
                                          f"{hello.direction} lane {hello.lane}: {why}")
            await reset_quietly(stream)
            return
        assert found is not None  # an honest dialer's link is open here (refused above otherwise)
        end, link = found
        await end.attach(link, stream, 4 + len(raw))


@asynccontextmanager
async def open_link_hub(sh: SwarmHost, penalties: Penalties, config: LinkConfig = LinkConfig(), *,
                        plan: tuple[str, int, int] | None = None, allow: Callable[[str], bool] | None = None,
                        named: Callable[[str, LinkHello], bool] | None = None):
    """The node's LinkHub for as long as the block runs; `plan`: (run id, stages, lanes) of the run it trains;
    `allow`: who may pull its AQ-SGD stores (None: anyone); `named`: whether the run's tables name a dialer at its
    end of a link (None: anyone the hello names may dial)."""
    async with trio.open_nursery() as nursery:
        hub = LinkHub(sh, penalties, config, nursery, plan, allow, named)
        try:
            yield hub
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                for end in list(hub._ends):
                    await end.aclose()
            hub.aq_stores.close()
            nursery.cancel_scope.cancel()


async def _refuse(stream, reason: str) -> None:
    try:
        body = encode_message(Refuse(reason=reason))
        with trio.move_on_after(1.0):
            await stream.write(LEN.pack(len(body)) + body)
    except Exception:  # noqa: BLE001
        pass
    await close_quietly(stream)
