"""A node's measured links to other peers, as it publishes them: round-trip time and achievable bandwidth each way,
smoothed (docs/placement.md, "Measured links").

Compact and bounded: integers in small units (0.1 ms, kbit/s), at most MAX_LINKS peers per report, one report per
node superseding the last (`seq`). A report is signed by the node that measured; what it says about a link counts
only as that end's view: a reader pairs it with the other end's report and keeps the worse figure
(swarm/run/linkbook.py), so no peer can make a link look better than the other end measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shoal.protocol.errors import FieldError
from shoal.protocol.records import PEER_ID, TIME_S
from shoal.protocol.schema import Int, Nested, Optional, Seq, SignedRecord, Str, WireRecord, spec

MAX_LINKS = 48  # peers per report: a node's lane neighbours, its group and a few candidates (~4 KB sealed)
MAX_RTT_100US = 100_000  # 10 s
MAX_KBPS = 10**9  # 1 Tbit/s


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFigure(WireRecord):
    """This node's view of its link to `peer`; 0 means not measured (yet)."""

    peer: str = spec(PEER_ID)
    rtt_100us: int = spec(Int(0, MAX_RTT_100US), default=0)  # round trip, in units of 0.1 ms
    up_kbps: int = spec(Int(0, MAX_KBPS), default=0)  # this node -> peer, achievable kbit/s
    down_kbps: int = spec(Int(0, MAX_KBPS), default=0)  # peer -> this node
    age_s: int = spec(Int(0, 10**6), default=0)  # seconds since the newest sample behind these figures

    @property
    def rtt_s(self) -> float:
        return self.rtt_100us / 1e4

    @property
    def up_bps(self) -> float:
        return self.up_kbps * 1e3

    @property
    def down_bps(self) -> float:
        return self.down_kbps * 1e3

    @classmethod
    def of(cls, peer: str, *, rtt_s: float, up_bps: float, down_bps: float, age_s: float = 0.0) -> LinkFigure:
        """From seconds and bit/s, rounded to the record's units (a measured non-zero figure stays non-zero)."""
        def units(x: float, scale: float, hi: int) -> int:
            return 0 if x <= 0 else min(hi, max(1, round(x * scale)))
        return cls(peer=peer, rtt_100us=units(rtt_s, 1e4, MAX_RTT_100US), up_kbps=units(up_bps, 1e-3, MAX_KBPS),
                   down_kbps=units(down_bps, 1e-3, MAX_KBPS), age_s=min(10**6, max(0, round(age_s))))


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkReport(SignedRecord):
    KIND: ClassVar[str] = "links"
    peer_id: str = spec(PEER_ID)  # the node that measured
    seq: int = spec(Int(0, 2**62))  # strictly increasing per node: an older report is ignored
    time: float = spec(TIME_S)
    run_id: str | None = spec(Optional(Str(80)), default=None)
    links: tuple[LinkFigure, ...] = spec(Seq(Nested(LinkFigure), MAX_LINKS), default=())

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        peers = [f.peer for f in self.links]
        if len(set(peers)) != len(peers):
            raise FieldError("links", "a peer is listed twice")
        if self.peer_id in peers:
            raise FieldError("links", "a node does not report a link to itself")

    def figure(self, peer: str) -> LinkFigure | None:
        return next((f for f in self.links if f.peer == peer), None)


LINK_RECORD_TYPES: dict[str, type[SignedRecord]] = {LinkReport.KIND: LinkReport}
