"""State transfer between real hosts on 127.0.0.1: bit-exact round trips, hostile streams, and the majority hash."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch
import trio

from shoal.node.run.config import RunConfig
from shoal.node.run.consistency import Consistency
from shoal.node.run.votes import HashVotes
from shoal.protocol.records import StatusRecord
from shoal.protocol.wire import pack
from shoal.swarm.net.framing import read_frame, write_frame
from shoal.swarm.net.rpc import RpcError
from shoal.swarm.run.group import Group
from shoal.swarm.state.snapshot import Snapshot, StateTransferError, flatten_state, state_hash, unflatten_state
from shoal.swarm.state.transfer import STATE_PROTOCOL, StateServer, StateTransferConfig, pull_state
from shoal.swarm.state.vote import agreed, holder
from tests.helpers.swarm import bare_host


def trainer_like_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {
        "format": 1, "run_id": "abc", "step": 7,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),  # int keys, tuples (betas), nested lists
        "rng": {"torch": torch.get_rng_state(), "python": random.Random(3).getstate()},
        "extra": {"bf16": torch.randn(5, 3).to(torch.bfloat16), "f16": torch.randn(2).half(),
                  "i64": torch.arange(6).reshape(2, 3), "mask": torch.tensor([True, False]),
                  "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "none": None, "nan": float("nan"),
                  "__odd": "a key that needs escaping", "blob": b"\x00\x01"},
        "last_eval_loss": None,
    }


def test_flatten_round_trip_keeps_types():
    state = trainer_like_state()
    tensors, skel = flatten_state(state)
    back = unflatten_state(tensors, skel)
    assert back["optimizer"]["param_groups"][0]["betas"] == state["optimizer"]["param_groups"][0]["betas"]
    assert isinstance(back["rng"]["python"], tuple) and back["rng"]["python"] == state["rng"]["python"]
    assert set(back["optimizer"]["state"]) == set(state["optimizer"]["state"])  # int keys survive
    assert back["extra"]["__odd"] == state["extra"]["__odd"]
    with pytest.raises(TypeError):
        flatten_state({"x": object()})


def test_state_hash_sees_every_bit():
    s = Snapshot.of(trainer_like_state(), revision=1)
    t = {k: v.clone() for k, v in s.tensors.items()}
    name = "/model/0.weight"
    t[name].view(-1)[0] = torch.nextafter(t[name].view(-1)[0], torch.tensor(1e9))
    assert state_hash(t, s.skeleton) != s.hash
    assert state_hash({k: v.clone() for k, v in s.tensors.items()}, s.skeleton) == s.hash


async def test_pull_round_trips_bit_exactly_and_loads():
    snap = Snapshot.of(trainer_like_state(), revision=5)
    async with bare_host() as server:
        StateServer(server, lambda: snap)
        async with bare_host(server.addrs) as client:
            got = await pull_state(client, server.peer_id)
            assert got.hash == snap.hash and got.revision == 5
            assert state_hash(got.tensors, got.skeleton) == snap.hash
            for k, v in snap.tensors.items():
                assert got.tensors[k].dtype == v.dtype and torch.equal(got.tensors[k], v)
            state = got.state()
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            model.load_state_dict(state["model"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            opt.load_state_dict(state["optimizer"])
            random.Random().setstate(state["rng"]["python"])
            # a size limit below the state is refused before any payload is read
            with pytest.raises(StateTransferError, match="larger than the limit"):
                await pull_state(client, server.peer_id, config=StateTransferConfig(max_total_bytes=100))
            with pytest.raises(StateTransferError, match="not the expected"):
                await pull_state(client, server.peer_id, expect_hash="0" * 64)


async def test_a_larger_state_moves():
    big = {"w": torch.randn(1024, 1024), "b": torch.randn(1024).to(torch.bfloat16)}  # ~4 MiB
    snap = Snapshot.of(big, revision=1)
    async with bare_host() as server:
        StateServer(server, lambda: snap)
        async with bare_host(server.addrs) as client:
            got = await pull_state(client, server.peer_id)
            assert got.hash == snap.hash and torch.equal(got.tensors["/w"], big["w"])


def _header(snap: Snapshot, **over) -> dict:
    names = sorted(snap.tensors)
    h = {"ok": True, "revision": snap.revision, "hash": snap.hash, "skeleton": pack(snap.skeleton),
         "tensors": [[n, str(snap.tensors[n].dtype).removeprefix("torch."), list(snap.tensors[n].shape),
                      snap.tensors[n].numel() * snap.tensors[n].element_size()] for n in names]}
    h.update(over)
    return h


def _payload(snap: Snapshot) -> bytes:
    return b"".join(bytes(snap.tensors[n].contiguous().view(-1).view(torch.uint8).numpy()) for n in sorted(snap.tensors))


HOSTILE = ["garbage", "bad_dtype", "huge_shape", "nbytes_mismatch", "flipped_bit", "truncated", "bad_hash",
           "refusal", "dangling_ref", "duplicate_name", "huge_frame"]


@pytest.mark.parametrize("fault", HOSTILE)
async def test_hostile_servers_are_rejected_cleanly(fault):
    snap = Snapshot.of({"w": torch.randn(4, 4), "n": torch.arange(3)}, revision=2)

    async def evil(stream):
        await read_frame(stream, 4096)
        payload = _payload(snap)
        if fault == "garbage":
            await stream.write(b"\x00\x00\x00\x10" + random.randbytes(16))
        elif fault == "huge_frame":
            await stream.write(b"\x7f\xff\xff\xff" + b"x" * 64)
        elif fault == "refusal":
            await write_frame(stream, pack({"ok": False, "e": "not now"}))
        else:
            h = _header(snap)
            if fault == "bad_dtype":
                h["tensors"][0][1] = "object"
            elif fault == "huge_shape":
                h["tensors"][0][2], h["tensors"][0][3] = [1 << 40, 1 << 40], 4 << 80
            elif fault == "nbytes_mismatch":
                h["tensors"][0][3] += 4
            elif fault == "bad_hash":
                h["hash"] = "xyz"
            elif fault == "dangling_ref":  # consistent hash, but the skeleton names a tensor that was not sent
                h["skeleton"] = pack({"a": {"__t": "/missing"}})
                h["hash"] = state_hash(snap.tensors, {"a": {"__t": "/missing"}})
            elif fault == "duplicate_name":
                h["tensors"][1][0] = h["tensors"][0][0]
            await write_frame(stream, pack(h))
            if fault == "flipped_bit":
                payload = bytearray(payload)
                payload[5] ^= 1
            if fault == "truncated":
                payload = payload[:-3]
            await stream.write(bytes(payload))
        await stream.close()

    async with bare_host() as server:
        server.set_handler(STATE_PROTOCOL, evil)
        async with bare_host(server.addrs) as client:
            cfg = StateTransferConfig(timeout_s=3.0)
            with pytest.raises(StateTransferError):
                await pull_state(client, server.peer_id, config=cfg)
            # the client is undisturbed: it still pulls from an honest server
            StateServer(server, lambda: snap)
            got = await pull_state(client, server.peer_id, config=cfg)
            assert got.hash == snap.hash


async def test_server_survives_garbage_requests():
    snap = Snapshot.of({"w": torch.ones(3)}, revision=1)
    async with bare_host() as server:
        StateServer(server, lambda: snap, config=StateTransferConfig(timeout_s=2.0))
        async with bare_host(server.addrs) as client:
            for junk in (b"", b"\x00\x00\x00\x02zz", b"\xff\xff\xff\xff", pack({"want": "nothing"})):
                s = await client.open_stream(server.peer_id, STATE_PROTOCOL)
                with trio.move_on_after(3):
                    await s.write(junk)
                    await s.close()
            got = await pull_state(client, server.peer_id)
            assert got.hash == snap.hash


async def test_server_with_nothing_to_serve_says_so():
    async with bare_host() as server:
        StateServer(server, lambda: None)
        async with bare_host(server.addrs) as client:
            with pytest.raises(StateTransferError, match="no state"):
                await pull_state(client, server.peer_id)


def test_the_agreed_hash_is_a_strict_majority_or_a_deterministic_choice_once_everyone_voted():
    votes = {"a": "h1", "b": "h1", "c": "h2"}
    assert agreed(votes, 3) == "h1" and holder(votes, "h1") == "a"
    assert agreed(votes, 4) is None  # a member that did not vote counts against every hash
    assert agreed(votes, 5) is None
    assert agreed({"a": "x", "b": "x"}, 2) == "x"
    assert agreed({}, 3) is None
    # a split of two has no majority: once both voted, the lowest hash, whichever replica holds it
    assert agreed({"a": "zz", "b": "aa"}, 2) == "aa" == agreed({"a": "aa", "b": "zz"}, 2)
    assert agreed({"a": "zz"}, 2) is None  # the other replica has not voted yet
    assert agreed({"a": "h3", "b": "h2", "c": "h1"}, 3) == "h1"  # three replicas, three hashes
    assert agreed({"a": "h2", "b": "h2", "c": "h1", "d": "h1"}, 4) == "h1"  # 2:2
    assert agreed({"a": "h2", "b": "h2", "c": "h1", "d": "h3"}, 4) == "h2"  # the most held, not the lowest
    # the same answer whatever the order of the votes
    assert agreed(dict(reversed(list(votes.items()))), 3) == "h1"
    assert holder({"c": "h1", "b": "h1", "a": "h2"}, "h1") == "b"


@pytest.mark.parametrize("third", ["holds none", "silent"])
async def test_a_member_that_holds_no_state_at_the_vote_step_has_no_say(third):
    """Two members that differ, and a third still entering the group (it answers that it holds no state at that
    step): the split of the two is decided at once (the third could not enter while they differ). A third that does
    not answer at all still counts against every hash: no decision."""
    me, b, c = "a" * 8, "b" * 8, "c" * 8
    mine = {5: "zz", 6: "zz", 7: "zz"}
    answers = {b: {5: "aa"}, c: {}}

    async def call(peer: str, method: str, step):
        assert method == "run.hash_at"
        if peer == c and third == "silent":
            raise RpcError("no answer")
        return {"hash": answers[peer].get(step)}

    votes = HashVotes(me, call)
    for step, h in mine.items():
        votes.record(step, h)
    g = Group(run_id="r" * 64, epoch=1, members=(me, b, c), me=me)
    src = await votes.vote(g)  # at step 7 - VOTE_LAG_STEPS = 5
    assert src == (b if third == "holds none" else None)


async def test_a_member_off_the_agreed_state_offends_only_when_still_off_after_its_grace():
    """A member the vote leaves in the minority has a grace of steps to re-fetch: votes held at steps within it
    (started by other claims, or by other voters) find it off again without counting a second loss; one after it
    that still finds it off makes it an offender. A member back on the agreed state starts afresh."""
    me, b, c = "a" * 8, "b" * 8, "c" * 8
    held: dict[str, dict[int, str]] = {me: {}, b: {}, c: {}}

    async def call(peer: str, method: str, step):
        return {"hash": held[peer].get(step)}

    def train(to: int, c_off_until: int) -> None:
        for step in range(len(held[me]) + 1, to + 1):
            for p in (me, b):
                held[p][step] = f"good{step}"
            held[c][step] = f"bad{step}" if step <= c_off_until else f"good{step}"
            votes.record(step, held[me][step])

    votes = HashVotes(me, call, grace_steps=8)
    g = Group(run_id="r" * 64, epoch=1, members=(me, b, c), me=me)
    train(30, c_off_until=30)
    for step in (5, 6, 9, 13, 3):  # the first loss, then votes within its grace (or before it)
        assert await votes.vote(g, {c: (step, held[c][step])}) is None
        assert votes.take_offenders() == {}
    assert await votes.vote(g, {c: (14, held[c][14])}) is None  # after the grace, still off
    assert "still off the group's agreed state at step 14" in votes.take_offenders()[c]

    held.update({me: {}, b: {}, c: {}})  # another run of the same shape: c re-fetches within its grace
    votes = HashVotes(me, call, grace_steps=8)
    train(30, c_off_until=11)
    assert await votes.vote(g, {c: (5, held[c][5])}) is None and votes.take_offenders() == {}
    assert await votes.vote(g, {b: (14, held[b][14])}) is None and votes.take_offenders() == {}  # on it again
    assert await votes.vote(g, {c: (9, held[c][9])}) is None and votes.take_offenders() == {}  # a new first loss
    assert await votes.vote(g, {c: (17, "bad17")}) is None
    assert "published state hash bad17" in votes.take_offenders()[c]  # it claimed a hash it does not vote

    held.update({me: {}, b: {}, c: {}})  # c re-fetches, publishes the agreed hash, and drifts again much later
    votes = HashVotes(me, call, grace_steps=8)
    train(60, c_off_until=5)
    held[c].update({step: f"bad{step}" for step in range(35, 61)})
    assert await votes.vote(g, {c: (5, held[c][5])}) is None and votes.take_offenders() == {}
    back = StatusRecord(peer_id=c, seq=1, time=time.time(), run_id="r" * 64, step=20, state_hash="good20")
    votes.note_claims(g, "r" * 64, [(c, back)])
    assert await votes.vote(g, {c: (40, held[c][40])}) is None and votes.take_offenders() == {}  # a new first loss


async def test_a_reloaded_state_replaces_the_hashes_of_the_states_held_before():
    """After a re-fetch at step 8 the node holds the agreed state there and none of the states before it: asked
    about them it holds none, so a vote about a step before the re-fetch cannot make it re-fetch again."""
    async def call(peer: str, method: str, step):
        return {"hash": f"agreed{step}"}

    votes = HashVotes("a" * 8, call)
    for step in range(1, 10):
        votes.record(step, f"drifted{step}")
    votes.reloaded(8, "agreed8")
    assert await votes.rpc_hash_at("b" * 8, 7) == {"hash": None}
    assert await votes.rpc_hash_at("b" * 8, 8) == {"hash": "agreed8"}
    assert await votes.rpc_hash_at("b" * 8, 9) == {"hash": "drifted9"}  # recorded after it: kept
    g = Group(run_id="r" * 64, epoch=1, members=("a" * 8, "b" * 8, "c" * 8), me="a" * 8)
    assert await votes.vote(g, {"b" * 8: (6, "agreed6")}) is None and votes.votes == 0  # no longer held: no vote
    assert await votes.vote(g, {"b" * 8: (8, "agreed8")}) is None and votes.votes == 1  # held now: it agrees


@pytest.mark.parametrize("case", ["all keep", "only the named keeps", "ahead", "named gone"])
async def test_a_refetch_is_planned_only_where_most_members_can_keep_the_state(case):
    """A minority replica plans its re-fetch at a step most of the other members (the one the vote named among them)
    are still before, so they keep their state there and a majority vouches for the state it pulls. A member at the
    step or past it cannot keep it: with most members past it the target moves once ahead of the furthest; with
    only the named member keeping it (the other silent) there is no re-fetch (the pull would rest on its word alone:
    a liar's)."""
    me, liar, honest = "a" * 8, "b" * 8, "c" * 8
    steps = {"all keep": {liar: 10, honest: 10}, "only the named keeps": {liar: 10, honest: None},
             "ahead": {liar: 14, honest: 15}, "named gone": {liar: None, honest: 10}}[case]
    asked: list[tuple[str, int]] = []

    async def call(peer: str, method: str, step):
        assert method == "run.snapshot_at"
        asked.append((peer, step))
        if steps[peer] is None:
            raise RpcError("no answer")
        return {"ok": True, "step": steps[peer]}

    cfg = RunConfig(run_id="r" * 64, switch_lead_min_steps=3)
    c = Consistency(SimpleNamespace(peer_id=me, clock=trio.current_time), cfg, None, None, call, lambda: "r" * 64,
                    lambda g, o: None)
    g = Group(run_id="r" * 64, epoch=1, members=(me, liar, honest), me=me)
    await c.plan_refetch(g, liar, 12)
    assert c.pending == {"all keep": (12, liar), "only the named keeps": None, "ahead": (18, liar),
                         "named gone": None}[case]
    assert sorted(s for _, s in asked) == ([12, 12, 18, 18] if case == "ahead" else [12, 12])


async def test_a_partial_pull_carries_only_the_asked_tensors_and_completes_from_a_base():
    """A promoted backup pulls only the group's synchronized tensors and completes them with its warm copy."""
    fresh = Snapshot.of(trainer_like_state(), revision=9)
    warm = Snapshot.of({**trainer_like_state(), "step": 3}, revision=3)  # same structure, older values
    async with bare_host() as server:
        StateServer(server, lambda: None, by_revision=lambda r: fresh if r == 9 else None)
        async with bare_host(server.addrs) as client:
            part = await pull_state(client, server.peer_id, revision=9, only=("/model/0.",))
            assert set(part.tensors) == {"/model/0.weight", "/model/0.bias"}
            assert part.nbytes < fresh.nbytes / 4
            whole = part.merged(warm)
            assert whole.state()["step"] == 7 and whole.revision == 9  # plain values: the fresh revision's
            assert torch.equal(whole.tensors["/model/0.weight"], fresh.tensors["/model/0.weight"])
            assert torch.equal(whole.tensors["/model/2.weight"], warm.tensors["/model/2.weight"])
            with pytest.raises(StateTransferError, match="did not send"):
                part.merged(Snapshot.of({"step": 1, "model": {}}, revision=1))  # a base without the other tensors
            with pytest.raises(StateTransferError):  # a malformed prefix list is refused
                await pull_state(client, server.peer_id, revision=9, only=("",))
