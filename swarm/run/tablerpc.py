"""run.table, both ends: what a peer answers (the table it follows, or its broker's, unless the caller already holds
that very one) and how a joining node asks any peer for a run's table. Every member polls the broker every poll_s
(the poll is also its beat): at 1,000 providers the table is ~38 KB, so an unchanged one travels as its 16-byte digest
in the question and not at all in the answer (docs/broker.md, "The table's size")."""

from __future__ import annotations

from typing import Any

from shoal.protocol.assignment import RUN_RECORD_TYPES, AssignmentTable
from shoal.protocol.envelope import Signed, open_envelope
from shoal.protocol.errors import ProtocolError
from shoal.protocol.tabledelta import DIGEST_LEN, table_digest
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.net.rpc import BadRequest, RpcError, call
from shoal.swarm.run.authority import RunAuthority


def table_answer(env: bytes, body: Any) -> bytes | None:
    """The table envelope a run.table answer carries: none when the caller's `have` names this very envelope, so that
    a poll of an unchanged table costs the lease, not the table (38 KB at 1,000 providers, from every member every
    poll_s). A `have` that is not 16 bytes is a bad request."""
    have = body.get("have") if isinstance(body, dict) else None
    if have is not None and (not isinstance(have, bytes) or len(have) != DIGEST_LEN):
        raise BadRequest(f"run.table: 'have' must be {DIGEST_LEN} bytes")
    if not env or (have is not None and have == table_digest(env)):
        return None
    return env


async def fetch_table(sh: SwarmHost, peer_id: str, run_id: str, *, timeout_s: float = 5.0,
                      authority: RunAuthority | None = None, penalties: Penalties | None = None) -> Signed:
    """Ask any peer for the latest table it knows of `run_id` (how a joining node finds the broker); with
    `authority`, only a table whose broker the run's owner authorised (a peer serving another is penalized: an
    honest peer serves only tables it accepted)."""
    ans = await call(sh, peer_id, "run.table", {"run_id": run_id}, timeout_s=timeout_s)
    if not isinstance(ans, dict) or not isinstance(ans.get("table"), bytes):
        raise RpcError(f"{peer_id[:16]}… knows no table for this run")
    try:
        signed = open_envelope(ans["table"], RUN_RECORD_TYPES)
    except ProtocolError as e:
        raise RpcError(f"{peer_id[:16]}… sent a bad table: {e}") from e
    if not isinstance(signed.record, AssignmentTable) or signed.record.run_id != run_id:
        raise RpcError(f"{peer_id[:16]}… sent a table of another run")
    why = authority.refuses(signed.record) if authority is not None else None
    if why is not None:
        if penalties is not None:
            penalties.penalize(peer_id, f"served a run table {why}")
        raise RpcError(f"{peer_id[:16]}… sent a table {why}")
    return signed
