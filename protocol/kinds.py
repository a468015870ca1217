"""Every signed record kind a peer may gossip or put in the DHT, by its KIND: the one table that gossip, the DHT
validator, membership and the dashboard's pipe open envelopes with."""

from __future__ import annotations

from shoal.protocol.advert import ADVERT_RECORD_TYPES
from shoal.protocol.assignment import RUN_RECORD_TYPES
from shoal.protocol.links import LINK_RECORD_TYPES
from shoal.protocol.records import NODE_RECORD_TYPES
from shoal.protocol.schema import SignedRecord
from shoal.protocol.tabledelta import TableDelta

RECORD_TYPES: dict[str, type[SignedRecord]] = {
    **NODE_RECORD_TYPES, **RUN_RECORD_TYPES, **LINK_RECORD_TYPES, **ADVERT_RECORD_TYPES, TableDelta.KIND: TableDelta,
}
