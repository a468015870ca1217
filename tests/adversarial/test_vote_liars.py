"""A member lying about its state hash (real in-process nodes on 127.0.0.1, a real broker, 3 replicas): its status
records publish a hash it does not hold, so honest members start hash votes. It is found lying at the first vote
(it answers otherwise than it published, or stays off the agreed state after losing), penalized and reported by
every honest member, evicted by the broker, and never makes the group vote again."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from shoal.protocol.assignment import GONE
from shoal.protocol.records import RunStatus
from tests.helpers.progress import wait_training
from tests.helpers.swarm import running_node, wait_for
from tests.swarm.test_run_runtime import hashes, manifest, node_config

pytestmark = [pytest.mark.slow, pytest.mark.own_process, pytest.mark.usefixtures("one_torch_thread")]

WATCH_S = 10.0


def lie_in_status(node) -> None:
    """From now on its status records publish a made-up hash for the step they name."""
    status = node.runtime.status

    def lying() -> RunStatus:
        out = status()
        return replace(out, state_hash="f" * len(out.state_hash)) if out.state_hash else out
    node.runtime.status = lying


@pytest.mark.parametrize("votes", ["honestly", "as-published"])
async def test_a_member_publishing_false_hashes_is_caught_at_the_first_vote_and_evicted(votes):
    steps = 400
    cfg = node_config(manifest("allreduce"), steps)
    async with running_node((), cfg) as first:
        async with running_node(first.sh.addrs, cfg) as second, running_node(first.sh.addrs, cfg) as liar:
            honest = [first, second]
            await wait_training([*honest, liar], 3, 8, 60, "training to get going")
            lie_in_status(liar)
            if votes == "as-published":  # and its answers to votes stand by the lie
                async def hash_at(caller, body):
                    ans = await liar.runtime.consistency.hashes.rpc_hash_at(caller, body)
                    return {"hash": "f" * len(ans["hash"])} if ans.get("hash") else ans
                liar.rpc.register("run.hash_at", hash_at)
            t0 = trio.current_time()
            await wait_for(lambda: all(n.penalties.reasons(liar.peer_id) for n in honest), WATCH_S,
                           "both honest members to find the liar")
            caught = trio.current_time() - t0
            await wait_for(lambda: first.runtime.client.table.provider_state(liar.peer_id) == GONE, 30,
                           "the broker to evict the liar")
            before = [n.runtime.consistency.hashes.claimants[liar.peer_id] for n in honest]
            await trio.sleep(WATCH_S)
            after = [n.runtime.consistency.hashes.claimants[liar.peer_id] for n in honest]
            print(f"a member publishing false hashes ({votes} voting): caught by both honest members after "
                  f"{caught:.1f} s, evicted; votes its claims started at the honest members: {before}, then {after} "
                  f"over the next {WATCH_S:.0f} s (votes in all: {[n.runtime.consistency.hashes.votes for n in honest]}); reason: "
                  f"{first.penalties.reasons(liar.peer_id)[-1]!r}")
            assert after == before and max(before) <= 2  # one vote (two when it votes as it published), then none
            # its ban has lapsed by now; its eviction has not: it is not seated again, and it stopped asking
            t = first.runtime.client.table
            assert liar.peer_id in t.evicted and t.provider_state(liar.peer_id) == GONE and liar.runtime.client.evicted()
            await wait_for(lambda: len(hashes(honest)) == 1, 30, "the honest replicas to agree")
