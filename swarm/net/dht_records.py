"""DHT keys under /shoal/: values must be signed envelopes from the peer the key names (or a newer one wins)."""

from __future__ import annotations

from libp2p.records.validator import Validator

from shoal.protocol.envelope import open_envelope
from shoal.protocol.errors import ProtocolError
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.records import Announcement
from shoal.protocol.wire import MAX_RECORD_BYTES

NAMESPACE = "shoal"


def announcement_key(peer_id: str) -> str:
    return f"/{NAMESPACE}/ann/{peer_id}"


class ShoalRecordValidator(Validator):
    """Accepts /shoal/<kind>/<peer_id> only when the value is a valid envelope signed by <peer_id>."""

    def validate(self, key: str, value: bytes) -> None:
        parts = key.split("/")
        if len(parts) != 4 or parts[1] != NAMESPACE:
            raise ValueError(f"not a shoal key: {key[:80]!r}")
        try:
            signed = open_envelope(value, RECORD_TYPES, max_bytes=MAX_RECORD_BYTES)
        except ProtocolError as e:
            raise ValueError(f"invalid shoal record at {key[:80]!r}: {e}") from e
        if signed.record.peer_id != parts[3]:
            raise ValueError(f"record at {key[:80]!r} is signed by another peer")

    def select(self, key: str, values: list[bytes]) -> int:
        best, best_t = 0, -1.0
        for i, v in enumerate(values):
            try:
                rec = open_envelope(v, RECORD_TYPES).record
            except ProtocolError:
                continue
            t = rec.started_at if isinstance(rec, Announcement) else float(getattr(rec, "time", 0.0))
            if t > best_t:
                best, best_t = i, t
        return best


def lease_key(broker_id: str) -> str:
    """Where a broker keeps its lease (signed by the broker, so the generic validator applies)."""
    return f"/{NAMESPACE}/lease/{broker_id}"


def table_key(broker_id: str) -> str:
    return f"/{NAMESPACE}/table/{broker_id}"
