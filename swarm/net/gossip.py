"""Signed records over GossipSub: publish our own, verify everyone else's, penalize senders of garbage."""

from __future__ import annotations

import logging
from collections.abc import Callable

from shoal.protocol.envelope import Signed, open_envelope
from shoal.protocol.errors import ProtocolError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.signing import b58encode
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

RECORDS_TOPIC = "/shoal/records/1"
MAX_GOSSIP_BYTES = 60 * 1024  # GossipSub silently drops large messages; stay far below


class RecordGossip:
    def __init__(self, sh: SwarmHost, penalties: Penalties, on_record: Callable[[Signed], None],
                 topic: str = RECORDS_TOPIC):
        self.sh = sh
        self.penalties = penalties
        self.on_record = on_record
        self.topic = topic
        self.rejected = 0

    async def publish(self, envelope: bytes) -> None:
        if len(envelope) > MAX_GOSSIP_BYTES:
            raise ValueError(f"record of {len(envelope)} bytes is too large for gossip ({MAX_GOSSIP_BYTES})")
        self.sh.control_bytes[0] += len(envelope)
        await self.sh.pubsub.publish(self.topic, envelope)

    def handle(self, origin: str, data: bytes) -> Signed | None:
        """Verify one gossiped message; the record must be signed by the peer that originated the message."""
        if self.penalties.is_banned(origin):
            return None
        self.sh.control_bytes[1] += len(data)
        try:
            signed = open_envelope(data, RECORD_TYPES, max_bytes=MAX_GOSSIP_BYTES)
            if signed.record.peer_id != origin:
                raise ProtocolError("record names a different peer than the one that published it")
        except ProtocolError as e:
            self.rejected += 1
            if self.penalties.penalize(origin, f"bad gossip record: {e}"):
                self.sh.pubsub.add_to_blacklist(_id(origin))
            return None
        self.on_record(signed)
        return signed

    async def run(self, *, task_status=None) -> None:
        sub = await self.sh.pubsub.subscribe(self.topic)
        if task_status is not None:
            task_status.started()
        while True:
            msg = await sub.get()
            try:
                origin = b58encode(msg.from_id)
                self.handle(origin, msg.data)
            except Exception as e:  # noqa: BLE001 - never let one message end the loop
                log.warning("gossip message dropped: %s: %s", type(e).__name__, e)


def _id(peer_id: str):
    from libp2p.peer.id import ID

    return ID.from_base58(peer_id)
