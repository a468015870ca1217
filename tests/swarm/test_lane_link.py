"""Lane links over real libp2p hosts on 127.0.0.1: round trips over 2 and 3 stages, a GPipe lane trained over them,
credit back-pressure, deadlines and dial failures as LinkError, hostile messages rejected and penalized without
disturbing other links, and byte counters equal to the formula in both directions."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import replace

import pytest
import torch
import trio

from shoal.node.train.lane import Boundary
from shoal.node.train.trainer import Trainer
from shoal.protocol.lane import (FWD, LANE_PROTOCOL, Act, Credit, Grad, LaneNorm, LinkHello, Nack, encode_message,
                                 lane_message_nbytes, payload_nbytes)
from shoal.protocol.wire import pack
from shoal.swarm.net.framing import read_frame
from shoal.swarm.net.penalty import Penalties, PenaltyConfig
from shoal.swarm.lane.blocking import BlockingLinkEnd
from shoal.swarm.lane.hub import open_link_hub
from shoal.swarm.lane.spec import LaneSpec, LinkConfig, LinkError, encode_tensor_frame
from tests.helpers.swarm import bare_host, wait_for
from tests.unit.test_pipeline_schedule import run_manifest

RUN = "r" * 64
B, T, H, M = 2, 4, 8, 3
FAST = LinkConfig(dial_timeout_s=2.0, send_timeout_s=2.0, recv_timeout_s=5.0, abort_timeout_s=1.0)


def spec(stage: int, peers: list[str], *, lane: int = 0, **kw) -> LaneSpec:
    """Slot (stage, lane) of a run of len(peers) stages and 2 lanes; peers[s] holds stage s of this lane."""
    return LaneSpec(**{
        "run_id": RUN, "lane": lane, "stage": stage, "num_stages": len(peers), "replicas": 2,
        "prev_peer": peers[stage - 1] if stage else None,
        "next_peer": peers[stage + 1] if stage + 1 < len(peers) else None,
        "micro_batch": B, "seq_len": T, "d_model": H, "micro_batches": M, "eval_batches": 2,
        "train_samples": 1000, "eval_samples": 100, **kw})


async def chain(stack: AsyncExitStack, n: int, *, config: LinkConfig = FAST, penalty: PenaltyConfig | None = None):
    """n hosts, each connected to the previous one, each with a link hub and its own penalties."""
    hosts = []
    for _ in range(n):
        h = await stack.enter_async_context(bare_host())
        if hosts:
            await h.connect(hosts[-1].addrs[0])
        hosts.append(h)
    pens = [Penalties(penalty or PenaltyConfig()) for _ in hosts]
    hubs = [await stack.enter_async_context(open_link_hub(h, p, config)) for h, p in zip(hosts, pens)]
    return hosts, pens, hubs


def acts(step: int, micro: int) -> torch.Tensor:
    return torch.randn(B, T, H, generator=torch.Generator().manual_seed(step * 100 + micro))


async def lane_step(ends, step: int, norms) -> dict:
    """One GPipe step of dummy tensors through a chain of LinkEnds; returns what each stage received."""
    got: dict = {s: {} for s in range(len(ends))}

    async def stage(s: int) -> None:
        end = ends[s]
        for m in range(M):
            if s == 0:
                x, ids = acts(step, m), list(range(m * B, m * B + B))
            else:
                ids, x = await end.recv_act(step, m)
                got[s][("act", m)] = (ids.tolist(), x)
            if s + 1 < len(ends):
                await end.send_act(step, m, ids, x + 1)
        for m in range(M):
            g = torch.full((B, T, H), float(s)) if s + 1 == len(ends) else await end.recv_grad(step, m)
            if s + 1 < len(ends):
                got[s][("grad", m)] = g
            if s > 0:
                await end.send_grad(step, m, g * 2)
        got[s]["norms"] = await end.exchange_norms(step, norms[s], True)

    async with trio.open_nursery() as n:
        for s in range(len(ends)):
            n.start_soon(stage, s)
    return got


@pytest.mark.parametrize("stages", [2, 3])
async def test_acts_grads_and_norms_round_trip(stages):
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, stages)
        peers = [h.peer_id for h in hosts]
        ends = [hub.open(spec(s, peers)) for s, hub in enumerate(hubs)]
        norms = [[0.5 * (s + 1), 2.0 + s] for s in range(stages)]
        for step in (0, 1):  # the streams persist: the second step dials nothing
            got = await lane_step(ends, step, norms)
            for s in range(1, stages):
                for m in range(M):
                    ids, x = got[s][("act", m)]
                    assert ids == list(range(m * B, m * B + B))
                    want = acts(step, m)
                    for _ in range(s):  # each stage forwards x + 1; fp32 arrives exact
                        want = want + 1
                    assert torch.equal(x, want)
            for s in range(stages - 1):
                for m in range(M):  # stage k sends 2 x what it got; the last sends its index
                    assert torch.equal(got[s][("grad", m)], torch.full((B, T, H), (stages - 1) * 2.0 ** (stages - 1 - s)))
            for s in range(stages):
                assert got[s]["norms"] == [(norms[k], True) for k in range(stages)]
        for end in ends:  # one hello per outbound link over both steps
            for link in end.links:
                assert link.failed is None
        assert not any(p.reasons(q) for p in pens for q in peers)


async def test_a_verified_lanes_tensors_carry_their_senders_signatures_and_a_forged_one_is_refused():
    """signed=True (a verified run): every training tensor is signed by its sender over what the receiver decodes;
    each end keeps its own signatures and its neighbours' for the micro-batch as evidence, each verifiable against
    the right peer. A stage signing with another key than its identity's has its activations refused: the step
    fails at the receiver with a violation and the sender is penalized."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.swarm.lane.signing import tensor_signed_by

    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        ends = [hub.open(spec(s, peers, signed=True)) for s, hub in enumerate(hubs)]
        got = await lane_step(ends, 0, [[1.0], [2.0]])
        assert not any(p.reasons(q) for p in pens for q in peers)
        for m in range(M):
            first, last = ends[0].signatures(0, m), ends[1].signatures(0, m)
            assert set(first) == {"act_out", "grad_in"} and set(last) == {"act_in", "grad_out"}
            assert first["act_out"] == last["act_in"] and first["grad_in"] == last["grad_out"]
            where = dict(run=RUN, lane=0, boundary=0, step=0, micro=m)
            ids, x = got[1][("act", m)]
            assert tensor_signed_by(peers[0], last["act_in"], x, direction=FWD, ids=tuple(ids), **where)
            assert not tensor_signed_by(peers[1], last["act_in"], x, direction=FWD, ids=tuple(ids), **where)
            assert tensor_signed_by(peers[1], first["grad_in"], got[0][("grad", m)], direction="bwd", ids=(), **where)
        ends[0].seals.key = Ed25519PrivateKey.generate()  # stage 0 signs as someone else
        await ends[0].send_act(1, 0, list(range(B)), acts(1, 0))
        with pytest.raises(LinkError) as e:
            await ends[1].recv_act(1, 0)
        assert e.value.cause == LinkError.VIOLATION and e.value.peer == peers[0]
        assert "without a valid signature" in pens[1].reasons(peers[0])[-1]


async def test_counters_equal_the_formula_both_ways():
    async with AsyncExitStack() as stack:
        hosts, _, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        s0, s1 = hubs[0].open(spec(0, peers, kind="fp16")), hubs[1].open(spec(1, peers, kind="fp16"))
        norms = [[1.5, 2.5, 0.25], [3.0]]
        await lane_step([s0, s1], 0, norms)
        fwd, bwd = s0.act_out, s1.grad_out
        # the last credits travel after the step: wait until both ends have seen every byte
        await wait_for(lambda: s1.act_in.sent == fwd.recv and s0.grad_in.sent == bwd.recv, 5, "the last credits")
        hdr = lambda x: encode_tensor_frame("fp16", x)[0]  # noqa: E731
        want_fwd = sum(lane_message_nbytes(Act(step=0, micro=m, kind="fp16", ids=tuple(range(m * B, m * B + B))),
                                           hdr(acts(0, m))) for m in range(M))
        want_fwd += lane_message_nbytes(LaneNorm(step=0, stage=0, norms=tuple(norms[0]), finite=True))
        want_bwd = sum(lane_message_nbytes(Grad(step=0, micro=m), hdr(torch.full((B, T, H), 2.0))) for m in range(M))
        want_bwd += lane_message_nbytes(LaneNorm(step=0, stage=1, norms=tuple(norms[1]), finite=True))
        assert fwd.sent.wire_bytes == want_fwd and bwd.sent.wire_bytes == want_bwd
        assert fwd.sent.payload_bytes == bwd.sent.payload_bytes == M * payload_nbytes("fp16", B, T, H) == M * B * T * H * 2
        assert fwd.sent.messages == bwd.sent.messages == M + 1
        # what one end counts sending, the other counts receiving, data and control alike
        assert s1.act_in.recv == fwd.sent and s0.grad_in.recv == bwd.sent
        assert s1.act_in.sent == fwd.recv and s0.grad_in.sent == bwd.recv
        hello = lambda d, a, b: LinkHello(run=RUN, boundary=0, lane=0, direction=d, peers=(a, b))  # noqa: E731
        assert fwd.sent.control_bytes == lane_message_nbytes(hello(FWD, peers[0], peers[1]))
        grants = lane_message_nbytes(Credit(n=FAST.credit_window)) + (M + 1) * lane_message_nbytes(Credit(n=1))
        assert fwd.recv.control_bytes == bwd.recv.control_bytes == grants
        assert s0.counters()["b0/fwd"]["sent"]["payload_bytes"] == M * B * T * H * 2


async def test_credit_window_blocks_the_sender_until_the_receiver_consumes():
    async with AsyncExitStack() as stack:
        hosts, _, hubs = await chain(stack, 2, config=replace(FAST, credit_window=2, send_timeout_s=0.5))
        peers = [h.peer_id for h in hosts]
        s0, s1 = hubs[0].open(spec(0, peers)), hubs[1].open(spec(1, peers))
        ids = list(range(B))
        await s0.send_act(0, 0, ids, acts(0, 0))
        await s0.send_act(0, 1, ids, acts(0, 1))
        assert s0.act_out.credits == 0
        with pytest.raises(LinkError) as e:  # the receiver consumes nothing: the third waits out its deadline
            await s0.send_act(0, 2, ids, acts(0, 2))
        assert e.value.cause == LinkError.DEADLINE and "credit" in str(e.value)
        assert s0.act_out.sent.messages == 2 and len(s1.act_in.inbox) == 2
        done = trio.Event()

        async def third() -> None:
            await s0.send_act(0, 2, ids, acts(0, 2))
            done.set()

        async with trio.open_nursery() as n:
            n.start_soon(third)
            await trio.sleep(0.2)
            assert not done.is_set() and s1.act_in.recv.messages == 2  # still held back
            _, x = await s1.recv_act(0, 0)  # one consumed: one credit back
            await wait_for(done.is_set, 5, "the third send")
        assert torch.equal(x, acts(0, 0))
        assert torch.equal((await s1.recv_act(0, 2))[1], acts(0, 2))


async def test_deadlines_dial_failures_and_refusals_raise_link_error():
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, 2, config=replace(FAST, recv_timeout_s=0.3, dial_timeout_s=0.5,
                                                                open_timeout_s=1.5))
        peers = [h.peer_id for h in hosts]
        s1 = hubs[1].open(spec(1, peers))
        t0 = trio.current_time()
        with pytest.raises(LinkError) as e:  # nobody sends
            await s1.recv_act(0, 0)
        assert e.value.cause == LinkError.DEADLINE and e.value.peer == peers[0]
        assert 0.25 < trio.current_time() - t0 < 2
        # lane 1 of the run is not open on hosts[1]: refused (no penalty), retried past one dial's deadline until
        # open_timeout_s
        s0 = hubs[0].open(spec(0, peers, lane=1))
        t0 = trio.current_time()
        with pytest.raises(LinkError) as e:
            await s0.send_act(0, 0, list(range(B)), acts(0, 0))
        assert e.value.cause == LinkError.DIAL and "refused" in str(e.value)
        assert 1.0 < trio.current_time() - t0 < 3, trio.current_time() - t0
        assert 3 <= hubs[1].refused <= 8, hubs[1].refused  # growing intervals: 0.1, 0.2, 0.4, 0.8 s
        assert not pens[1].reasons(peers[0])
        # a neighbour that is not there at all
        async with bare_host() as gone:
            ghost = gone.peer_id
        s9 = hubs[0].open(spec(0, [peers[0], ghost], lane=0, run_id="g" * 64))
        with pytest.raises(LinkError) as e:
            await s9.send_act(0, 0, list(range(B)), acts(0, 0))
        assert e.value.cause == LinkError.DIAL and e.value.peer == ghost


async def test_a_replacement_that_dials_before_the_survivor_moved_is_refused_unpenalized_then_served():
    """A promoted backup may dial a surviving neighbour whose end of the link still names the peer it replaces
    (the survivor has not reached the step of the new table yet): that is refused without a strike, and the dial
    succeeds once the survivor opens its end to the replacement, within the dial deadline."""
    async with AsyncExitStack() as stack:
        lenient = replace(FAST, dial_timeout_s=5.0)
        (old, survivor, new), pens, hubs = await chain(stack, 3, config=lenient)
        await new.connect(survivor.addrs[0])
        stale = hubs[1].open(spec(1, [old.peer_id, survivor.peer_id]))
        fresh = hubs[2].open(spec(0, [new.peer_id, survivor.peer_id]))
        got: list = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: fresh.send_act(0, 0, list(range(B)), acts(0, 0)))
            await wait_for(lambda: hubs[1].refused >= 2, 5, "the replacement's dial refused more than once")
            assert not pens[1].reasons(new.peer_id) and not pens[1].is_banned(new.peer_id)
            await stale.aclose()
            moved = hubs[1].open(spec(1, [new.peer_id, survivor.peer_id]))
            got.append(await moved.recv_act(0, 0))
        assert torch.equal(got[0][1], acts(0, 0))
        assert not pens[1].reasons(new.peer_id)


async def test_a_neighbour_that_opens_its_end_after_a_dial_deadline_is_still_reached():
    """A replacement entering its slot opens its end of the link only once it holds its group's state and its
    AQ-SGD stores, which may take longer than one dial; its neighbours dialing for the switch step are refused
    meanwhile and keep dialing (within open_timeout_s), so the lane's step does not fail on that wait."""
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, 2, config=replace(FAST, dial_timeout_s=0.3, open_timeout_s=5.0))
        peers = [h.peer_id for h in hosts]
        hubs[1].open(spec(1, peers, lane=1))  # the run is known there; lane 0's end is not open yet
        s0 = hubs[0].open(spec(0, peers))
        got: list = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: s0.send_act(0, 0, list(range(B)), acts(0, 0)))
            await trio.sleep(1.0)  # three dial deadlines: the dialer is refused and still dialing
            assert hubs[1].refused >= 3
            s1 = hubs[1].open(spec(1, peers))
            got.append(await s1.recv_act(0, 0))
        assert torch.equal(got[0][1], acts(0, 0))
        assert not pens[1].reasons(peers[0])


async def test_dialing_a_refusing_neighbour_stops_when_the_step_is_given_up_or_the_node_leaves():
    async with AsyncExitStack() as stack:
        hosts, _, hubs = await chain(stack, 2, config=replace(FAST, dial_timeout_s=0.3, open_timeout_s=30.0))
        peers = [h.peer_id for h in hosts]
        hubs[1].open(spec(1, peers, lane=1))  # lane 0's end never opens there

        async def abort(end) -> None:
            await end.abort(0, "given up here")

        async def halt(end) -> None:
            end.halt("this node is leaving the run")

        for stop in (abort, halt):
            s0 = hubs[0].open(spec(0, peers))
            got: list[LinkError] = []

            async def send(end=s0) -> None:
                try:
                    await end.send_act(0, 0, list(range(B)), acts(0, 0))
                except LinkError as e:
                    got.append(e)
            t0 = trio.current_time()
            async with trio.open_nursery() as n:
                n.start_soon(send)
                await trio.sleep(0.5)
                assert not got  # still dialing
                await stop(s0)
            assert [e.cause for e in got] == [LinkError.ABORTED], got
            assert trio.current_time() - t0 < 3  # not open_timeout_s
            await s0.aclose()


async def test_an_abort_reaches_the_neighbour_at_once():
    async with AsyncExitStack() as stack:
        hosts, _, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        s0, s1 = hubs[0].open(spec(0, peers)), hubs[1].open(spec(1, peers))
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(s0.abort, 0, "stage 0 failed")
            with pytest.raises(LinkError) as e:
                await s1.recv_act(0, 0)
        assert e.value.cause == LinkError.ABORTED and "stage 0 failed" in str(e.value)
        assert trio.current_time() - t0 < FAST.recv_timeout_s / 2
        got = await lane_step([s0, s1], 1, [[1.0], [2.0]])  # the next step goes through
        assert got[0]["norms"] == [([1.0], True), ([2.0], True)]


async def test_closing_an_end_fails_a_wait_on_it_at_once():
    """A rollback closes the lane's ends to free a step waiting on a dead neighbour: the wait fails at once instead
    of sitting out its receive deadline while it expects the neighbour to dial again."""
    async with AsyncExitStack() as stack:
        hosts, _, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        hubs[0].open(spec(0, peers))
        s1 = hubs[1].open(spec(1, peers))
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            async def close_soon():
                await trio.sleep(0.2)
                await s1.aclose()
            n.start_soon(close_soon)
            with pytest.raises(LinkError) as e:
                await s1.recv_act(0, 0)
        assert e.value.cause == LinkError.ABORTED, e.value
        assert trio.current_time() - t0 < FAST.recv_timeout_s / 2


# -- hostile neighbours ----------------------------------------------------------------------------------------

def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def act_msg(step: int, *, x: torch.Tensor | None = None, kind: str = "fp32", **rec) -> bytes:
    x = acts(step, 0) if x is None else x
    rec = {"step": step, "micro": 0, "kind": kind, "ids": tuple(range(B)), **rec}
    tensor = encode_tensor_frame(kind, x)[1] if kind == "fp32" or x.isfinite().all() else None
    if tensor is None:  # non-finite values: built by hand, as a hostile peer would
        from shoal.protocol.frames import encode_frame, make_header
        mv = memoryview(x.contiguous().numpy()).cast("B")
        head, body = encode_frame(make_header("none", "float32", x.shape, 32, 0, 0, mv), mv)
        tensor = bytes(head) + bytes(body)
    return frame(encode_message(Act(**rec))) + frame(tensor)


def nan_act(step: int) -> bytes:
    x = acts(step, 0)
    x[0, 0, 0] = float("nan")
    from shoal.protocol.frames import encode_frame, make_header
    mv = memoryview(x.contiguous().numpy()).cast("B")
    head, body = encode_frame(make_header("none", "float32", x.shape, 32, 0, 0, mv), mv)
    return frame(encode_message(Act(step=step, micro=0, kind="fp32", ids=tuple(range(B))))) + frame(bytes(head) + bytes(body))


# name -> (hello overrides, the bytes sent after the hello at lane step `s`, what the penalty reason says,
#          whether the victim's step is aborted (False: rejected at the hello, the link never reached))
FAULTS = {
    "wrong step": ({}, lambda s: act_msg(s + 5), "while the lane is at step", True),
    "wrong shape": ({}, lambda s: act_msg(s, x=torch.zeros(B, H, T)), "expected none float32 [2, 4, 8]", True),
    "too many values": ({}, lambda s: act_msg(s, x=torch.zeros(B, T, H + 1)), "more than 64 elements", True),
    "non-finite": ({}, nan_act, "non-finite values", True),
    "wrong id count": ({}, lambda s: act_msg(s, ids=(1,)), "sample ids", True),
    "id out of range": ({}, lambda s: act_msg(s, ids=(1, 1000)), "sample ids", True),
    "micro out of range": ({}, lambda s: act_msg(s, micro=M), "micro-batch 3 of 3", True),
    "wrong kind": ({}, lambda s: act_msg(s, kind="fp16"), "this run sends fp32", True),
    "gradient on the forward link": ({}, lambda s: frame(encode_message(Grad(step=s, micro=0))), "where only", True),
    "nack on a dense link": ({}, lambda s: frame(encode_message(Nack(step=s, micro=0, rows=(0,)))), "where only", True),
    "norms from the wrong side": ({}, lambda s: frame(encode_message(LaneNorm(step=s, stage=1, norms=(), finite=True))),
                                  "cannot come from this side", True),
    "oversized record frame": ({}, lambda s: (10 << 20).to_bytes(4, "big") + b"x" * 64, "exceeds", True),
    "oversized tensor frame": ({}, lambda s: frame(encode_message(Act(step=s, micro=0, kind="fp32", ids=(0, 1))))
                               + (1 << 24).to_bytes(4, "big"), "exceeds the limit", True),
    "garbage record": ({}, lambda s: frame(b"\xc1\x00garbage"), "not valid msgpack", True),
    "bad record": ({}, lambda s: frame(pack({"t": "act", "r": {"step": s, "micro": -1}})), "micro", True),
    "duplicate": ({}, lambda s: act_msg(s, micro=1) + act_msg(s, micro=1), "sent twice", True),
    "past its credit": ({}, lambda s: b"".join(act_msg(t, micro=m) for t, m in [(s, 1), (s, 2), (s + 1, 0),
                                                                              (s + 1, 1), (s + 1, 2)]),
                        "more than its credit", True),
    "wrong run": ({"run": "x" * 64}, None, "wrong run", False),
    "unknown lane": ({"lane": 7}, None, "unknown lane or boundary", False),
    "unknown boundary": ({"boundary": 5}, None, "unknown lane or boundary", False),
    "hello naming other peers": ({"peers": "swapped"}, None, "names other peers", False),
}


async def hostile_dial(attacker, victim: str, hello: dict, payload: bytes | None) -> None:
    stream = await attacker.open_stream(victim, LANE_PROTOCOL)
    h = {"run": RUN, "boundary": 0, "lane": 0, "direction": FWD, "peers": (attacker.peer_id, victim), **hello}
    if h["peers"] == "swapped":
        h["peers"] = (victim, attacker.peer_id)
    await stream.write(frame(encode_message(LinkHello(**h))))
    if payload is not None:
        await read_frame(stream, 1024)  # the first credit
        await stream.write(payload)


async def test_hostile_messages_are_rejected_penalized_and_abort_only_that_lanes_step():
    """One victim (stage 1 of lanes 0 and 1): lane 0's stage 0 misbehaves in every way of FAULTS in turn (the
    victim waiting for micro-batch 0, which never comes right), while lane 1's honest stage 0 keeps sending; after
    each attack, lane 0 goes on at the next step. (One test walks the table: three hosts per case would cost ~1 s
    each.)"""
    async with AsyncExitStack() as stack:
        lenient = PenaltyConfig(strikes_before_ban=10**6)  # to count every violation (bans are tested elsewhere)
        (attacker, victim, honest), pens, hubs = await chain(stack, 3, penalty=lenient)
        await honest.connect(victim.addrs[0])
        assert FAST.credit_window == 4  # "past its credit" sends 5 messages the victim does not consume
        v0 = hubs[1].open(spec(1, [attacker.peer_id, victim.peer_id]))
        v1 = hubs[1].open(spec(1, [honest.peer_id, victim.peer_id], lane=1))
        a0 = hubs[0].open(spec(0, [attacker.peer_id, victim.peer_id]))  # the attacker's honest side, for recovery
        h1 = hubs[2].open(spec(0, [honest.peer_id, victim.peer_id], lane=1))
        for i, (name, (hello, payload, reason, aborts)) in enumerate(FAULTS.items()):
            step = 2 * i
            outcome: list = []

            async def victim_waits() -> None:
                try:
                    outcome.append(await v0.recv_act(step, 0))
                except LinkError as e:
                    outcome.append(e)

            strikes = pens[1].strikes(attacker.peer_id)
            async with trio.open_nursery() as n:
                n.start_soon(victim_waits)
                await wait_for(lambda: v0.step == step, 5, "the victim at its step")
                n.start_soon(hostile_dial, attacker, victim.peer_id, hello, payload and payload(step))
                # lane 1 is served throughout
                await h1.send_act(step, 0, list(range(B)), acts(step, 1))
                assert torch.equal((await v1.recv_act(step, 0))[1], acts(step, 1)), name
                # this case's violation (the previous case may have had the same reason)
                await wait_for(lambda: pens[1].strikes(attacker.peer_id) > strikes, 5, f"{name}: a new violation")
                assert reason in pens[1].reasons(attacker.peer_id)[-1], (name, pens[1].reasons(attacker.peer_id))
                if aborts:
                    await wait_for(lambda: outcome, 5, f"{name}: the victim's step aborted")
                    assert isinstance(outcome[0], LinkError) and outcome[0].cause == LinkError.VIOLATION, (name, outcome)
                    assert outcome[0].peer == attacker.peer_id
                else:
                    assert not outcome, name
                    n.cancel_scope.cancel()
            assert not pens[1].reasons(honest.peer_id), name
            # lane 0 recovers at the next step: the attacker's side dials afresh and behaves
            await a0.send_act(step + 1, 0, list(range(B)), acts(step + 1, 0))
            ids, x = await v0.recv_act(step + 1, 0)
            assert ids.tolist() == list(range(B)) and torch.equal(x, acts(step + 1, 0)), name
        assert len(pens[1].reasons(attacker.peer_id)) == 5  # the ledger keeps the last five reasons


# -- the GPipe schedule over the network ---------------------------------------------------------------------

@pytest.mark.usefixtures("one_torch_thread")
async def test_a_two_stage_lane_over_links_is_the_unsplit_model_bit_for_bit():
    m = run_manifest(2)
    steps = 4
    m = replace(m, eval=replace(m.eval, every_steps=2))
    ref = Trainer(run_manifest(1, eval=m.eval))
    want = [ref.step() for _ in range(steps)]
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        token = trio.lowlevel.current_trio_token()
        stages = []
        corpus = ref.corpus
        for s in range(2):
            end = hubs[s].open(LaneSpec.from_manifest(
                m, stage=s, lane=0, prev_peer=peers[0] if s else None, next_peer=None if s else peers[1],
                train_samples=ref.train_samples.num_samples, eval_samples=ref.heldout_samples.num_samples,
                kind="fp32", eval_kind="fp32"))
            boundary = BlockingLinkEnd(end, token)
            assert isinstance(boundary, Boundary)
            stages.append(Trainer(m, stage=s, replica=0, boundary=boundary, corpus=corpus))
        results: dict[int, list] = {}

        async def run(s: int) -> None:
            results[s] = await trio.to_thread.run_sync(lambda: [stages[s].step() for _ in range(steps)])

        async with trio.open_nursery() as n:
            for s in range(2):
                n.start_soon(run, s)
        counters = stages[0].boundary.end.counters()["b0/fwd"]["sent"]
    assert [r.loss for r in results[1]] == [w.loss for w in want]
    assert [r.eval_loss for r in results[1]] == [w.eval_loss for w in want]
    params = {**stages[0].model.state_dict(), **stages[1].model.state_dict()}
    for k, v in ref.model.state_dict().items():
        assert torch.equal(params[k], v), k
    mb = m.batch.micro_batch_size * m.batch.seq_len * m.model.d_model * 4
    n_micro = m.batch.batch_size // m.batch.micro_batch_size
    assert counters["payload_bytes"] == (steps * n_micro + 2 * m.eval.batches) * mb
