"""A run's advertisement: the signed record by which a swarm's peers list its runs and a volunteer finds one.

The run's broker publishes it every few seconds. It carries the run's signed manifest itself (so whoever lists the run
checks the id, the owner's signature and the broker's authority without asking anybody) and what changes as the run
goes: its lanes now, how many more it takes, its backups and its step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shoal.protocol.assignment import MAX_REPLICAS, MAX_PROVIDERS, RUN_ID
from shoal.protocol.errors import FieldError
from shoal.protocol.records import PEER_ID, TIME_S
from shoal.protocol.schema import Bytes, Int, Optional, SignedRecord, WireRecord, spec

#: a manifest larger than this (a long allowlist) is not advertised: its run is joined by its id or file
MAX_ADVERT_MANIFEST_BYTES = 16 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class RunAdvert(SignedRecord):
    """One run as its broker (`peer_id`, the signer) advertises it."""

    KIND: ClassVar[str] = "run"
    peer_id: str = spec(PEER_ID)  # the broker
    run_id: str = spec(RUN_ID)
    time: float = spec(TIME_S)  # issued at (unix seconds); the newest per run wins
    manifest: bytes = spec(Bytes(MAX_ADVERT_MANIFEST_BYTES))  # the signed manifest (RunManifest.to_bytes)
    # the owner's sealed BrokerDelegation naming this broker (a broker that is not the run's owner carries it)
    delegation: bytes | None = spec(Optional(Bytes(4096)), default=None, omit_if_default=True)
    lanes: int = spec(Int(0, MAX_REPLICAS))  # complete lanes (replicas) training now
    free_lanes: int = spec(Int(0, MAX_REPLICAS))  # lanes the run still takes before its maximum
    backups: int = spec(Int(0, MAX_PROVIDERS), default=0)
    providers: int = spec(Int(0, MAX_PROVIDERS), default=0)  # nodes admitted and not gone
    step: int = spec(Int(0, 2**62), default=0)  # the furthest step its members report

    def __post_init__(self) -> None:
        WireRecord.__post_init__(self)
        if self.lanes + self.free_lanes > MAX_REPLICAS:
            raise FieldError("free_lanes", f"more than {MAX_REPLICAS} lanes in all")


ADVERT_RECORD_TYPES: dict[str, type[SignedRecord]] = {RunAdvert.KIND: RunAdvert}
