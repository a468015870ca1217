"""Opening a lane link: dial the neighbour, say hello, and read its first credit (the link is open) or its refusal
(its end is not open yet: it is still entering its slot), dialing again at growing intervals (docs/pipeline.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.lane import LANE_PROTOCOL, Credit, LaneMessage, LinkHello, Refuse, decode_message, encode_message
from shoal.swarm.lane.spec import LEN, MAX_CONTROL_BYTES, Link, LinkConfig, LinkError, reset_quietly
from shoal.swarm.net.framing import close_quietly, read_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties


async def dial(sh: SwarmHost, penalties: Penalties, cfg: LinkConfig, link: Link, hello: LinkHello,
               still_wanted: Callable[[], None]) -> tuple[Any, int]:
    """(stream, first credit) of `link`'s neighbour. Each dial must be answered within dial_timeout_s; a refusal is
    dialed again until open_timeout_s has passed; `still_wanted` raises (a LinkError) to stop waiting between dials.
    A malformed answer penalizes the neighbour. Control bytes are counted on the link."""
    patience = max(cfg.dial_timeout_s, cfg.open_timeout_s)
    give_up = trio.current_time() + patience
    interval = cfg.retry_interval_s
    refused = ""
    while True:
        stream = None
        try:
            with trio.fail_after(cfg.dial_timeout_s):
                stream = await sh.open_stream(link.peer, LANE_PROTOCOL)
                body = encode_message(hello)
                await stream.write(LEN.pack(len(body)) + body)
                raw = await read_frame(stream, MAX_CONTROL_BYTES)
                reply: LaneMessage = decode_message(raw, frozenset({Credit.TYPE, Refuse.TYPE}))
        except trio.TooSlowError:
            await reset_quietly(stream)
            why = f"refused: {refused}" if refused else f"no answer within {cfg.dial_timeout_s:g} s"
            raise LinkError(LinkError.DIAL, why, link.peer) from None
        except ProtocolError as e:
            await reset_quietly(stream)
            penalties.penalize(link.peer, f"lane link: bad answer to hello: {e}")
            raise LinkError(LinkError.VIOLATION, f"bad answer to hello: {e}", link.peer) from e
        except Exception as e:  # noqa: BLE001 - dial errors come as many types from py-libp2p
            await reset_quietly(stream)
            raise LinkError(LinkError.DIAL, f"{type(e).__name__}: {e}", link.peer) from e
        link.sent.control_bytes += 4 + len(body)
        link.recv.control_bytes += 4 + len(raw)
        if isinstance(reply, Credit):
            return stream, reply.n
        await close_quietly(stream)
        refused = reply.reason if isinstance(reply, Refuse) else ""
        still_wanted()
        now = trio.current_time()
        if now >= give_up:
            raise LinkError(LinkError.DIAL, f"refused for {patience:g} s: {refused}", link.peer)
        await trio.sleep(min(interval, give_up - now))
        interval = min(2 * interval, cfg.max_retry_interval_s)
