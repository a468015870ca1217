"""What this node's DHT stores for others: shoal's namespace and libp2p's public keys only, within per-peer and total
quotas of records and bytes; a peer that puts anything else is refused and penalized."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass

from libp2p.records.validator import NamespacedValidator, Validator

log = logging.getLogger(__name__)

_sender: ContextVar[str | None] = ContextVar("shoal_dht_sender", default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class DhtQuotaConfig:
    records_per_peer: int = 64  # a node puts a handful of keys (its announcement, a broker its lease and table)
    bytes_per_peer: int = 1024 * 1024
    records_total: int = 16384
    bytes_total: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if min(self.records_per_peer, self.bytes_per_peer, self.records_total, self.bytes_total) < 1:
            raise ValueError("DHT quotas must be positive")


class DhtQuota(NamespacedValidator):
    """The DHT's validator: strict namespaces (no fallback for unknown keys), and every record a peer puts here is
    charged to that peer (the stream's remote peer, set by `wrap`) until it leaves the store. Records this node puts
    or fetches itself are not charged (no sender)."""

    def __init__(self, validators: dict[str, Validator], config: DhtQuotaConfig = DhtQuotaConfig(), *,
                 stored: Callable[[str], bool] = lambda key: True):
        super().__init__(validators, strict_validation=True)
        self.config = config
        self.stored = stored  # whether a key is still in the value store (expired records stop counting)
        self.charged: dict[str, dict[str, int]] = {}  # sender -> key -> bytes
        self.refused = 0
        self.on_refuse: Callable[[str, str], None] | None = None  # (peer, why): the node penalizes it
        self.banned: Callable[[str], bool] = lambda peer: False  # a banned peer's DHT streams are reset unread

    def wrap(self, handler: Callable[[object], Awaitable[None]]) -> Callable[[object], Awaitable[None]]:
        """The DHT's stream handler, knowing which peer is putting (so the validator can charge it)."""
        async def handle(stream) -> None:
            peer = stream.muxed_conn.peer_id.to_base58()
            if self.banned(peer):
                self.refused += 1
                try:
                    await stream.reset()
                except Exception:  # noqa: BLE001 - a stream handler must not raise
                    pass
                return
            _sender.set(peer)
            await handler(stream)
        return handle

    def validate(self, key: str, value: bytes) -> None:
        sender = _sender.get()
        try:
            super().validate(key, value)
        except Exception as e:
            if sender is not None:
                self._refuse(sender, f"dht record refused: {type(e).__name__}: {str(e)[:120]}")
            raise
        if sender is not None:
            self._charge(sender, key, len(value))

    def _refuse(self, sender: str, why: str) -> None:
        self.refused += 1
        if self.on_refuse is not None:
            try:
                self.on_refuse(sender, why)
            except Exception as e:  # noqa: BLE001 - the DHT's handler must not die of a listener
                log.warning("dht refusal listener failed: %s", e)

    def _charge(self, sender: str, key: str, size: int) -> None:
        c = self.config
        mine = self.charged.setdefault(sender, {})
        for k in [k for k in mine if k != key and not self.stored(k)]:
            del mine[k]
        total_records = sum(len(v) for v in self.charged.values())
        total_bytes = sum(sum(v.values()) for v in self.charged.values())
        old = mine.get(key, 0)
        new_key = key not in mine
        why = None
        if new_key and len(mine) >= c.records_per_peer:
            why = f"over its quota of {c.records_per_peer} records"
        elif sum(mine.values()) - old + size > c.bytes_per_peer:
            why = f"over its quota of {c.bytes_per_peer} bytes"
        elif (new_key and total_records >= c.records_total) or total_bytes - old + size > c.bytes_total:
            why = "the store is full"
        if why is not None:
            if not mine:
                del self.charged[sender]
            self._refuse(sender, f"dht put refused: {why}")
            raise ValueError(f"dht put refused: {why}")
        mine[key] = size
