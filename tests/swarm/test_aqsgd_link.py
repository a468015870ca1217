"""AQ-SGD on lane links over real libp2p hosts on 127.0.0.1: a 3-stage lane trained over a small train subset for
several epochs with both ends' store digests equal after every step and the stores byte-equal at the end (and its
losses close to the unsplit fp32 model's); bytes per micro-batch equal to the formula before and after first visits;
a corrupted version repaired by exactly one NACK and resend; hostile AQ-SGD messages rejected and penalized."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import replace

import pytest
import torch
import trio

from shoal.node.train.trainer import Trainer
from shoal.protocol.frames import encode_frame, make_header
from shoal.protocol.lane import Act, Grad, LaneNorm, Nack, encode_message, lane_message_nbytes
from shoal.swarm.net.penalty import PenaltyConfig
from shoal.swarm.lane.aq_codec import AQSpec, encode_acts, encode_group, group_nbytes
from shoal.swarm.lane.aq_handover import StoreKey
from shoal.swarm.lane.aq_store import LinkStore, StoreConfig
from shoal.swarm.lane.blocking import BlockingLinkEnd
from shoal.swarm.lane.spec import LaneSpec, LinkError
from tests.helpers.swarm import wait_for
from tests.swarm.test_lane_link import RUN, B, H, M, T, acts, chain, frame, hostile_dial, spec
from tests.unit.test_pipeline_schedule import run_manifest

AQS = AQSpec()  # fw 4, bw 8, first visits at 8 bits, in memory


def aq_spec(stage: int, peers: list[str], **kw) -> LaneSpec:
    return spec(stage, peers, kind="aqsgd", aq=AQS, **kw)


def ids_of(micro: int) -> list[int]:
    return list(range(micro * B, micro * B + B))


async def aq_step(ends, step: int) -> dict:
    """One GPipe step of two stages: stage 0 sends acts(step, m) for samples ids_of(m); stage 1 returns gradients
    of 0.5 · what it received. Returns what stage 1 received and stage 0 got back."""
    got: dict = {}

    async def first() -> None:
        for m in range(M):
            await ends[0].send_act(step, m, ids_of(m), acts(step, m))
        for m in range(M):
            got["grad", m] = await ends[0].recv_grad(step, m)
        await ends[0].exchange_norms(step, [1.0], True)

    async def last() -> None:
        for m in range(M):
            ids, x = await ends[1].recv_act(step, m)
            got["act", m] = (ids.tolist(), x)
        for m in range(M):
            await ends[1].send_grad(step, m, 0.5 * got["act", m][1])
        await ends[1].exchange_norms(step, [2.0], True)

    async with trio.open_nursery() as n:
        n.start_soon(first)
        n.start_soon(last)
    return got


async def test_bytes_per_micro_batch_equal_the_formula_before_and_after_first_visits():
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        s0, s1 = hubs[0].open(aq_spec(0, peers)), hubs[1].open(aq_spec(1, peers))
        shadow = LinkStore(StoreConfig(row_shape=(T, H), train_samples=1000))  # the sender's algorithm, replayed
        fwd, bwd = s0.act_out, s1.grad_out
        for step in (0, 1, 2):
            before_f, before_b = (fwd.sent.wire_bytes, fwd.sent.payload_bytes), (bwd.sent.wire_bytes,
                                                                                   bwd.sent.payload_bytes)
            got = await aq_step([s0, s1], step)
            want_wire = lane_message_nbytes(LaneNorm(step=step, stage=0, norms=(1.0,), finite=True))
            want_grad = lane_message_nbytes(LaneNorm(step=step, stage=1, norms=(2.0,), finite=True))
            for m in range(M):
                enc = encode_acts(AQS, shadow, ids_of(m), acts(step, m), set(), set())
                base = (0,) * B if step == 0 else (step,) * B  # the row of sample i was last written at step - 1
                assert enc.base_versions == base
                for sid, row in enc.rows:
                    shadow.put(sid, step + 1, row)
                rec = Act(step=step, micro=m, kind="aqsgd", ids=tuple(ids_of(m)), base_versions=base,
                          n_first=B if step == 0 else 0, bits=4)
                want_wire += lane_message_nbytes(rec, *enc.headers)
                ids, x = got["act", m]
                assert ids == ids_of(m) and torch.equal(x, torch.stack([r for _, r in enc.rows]).float())
                h = encode_group(0.5 * x, 8)[0]
                want_grad += lane_message_nbytes(Grad(step=step, micro=m, ack=True), h)
            # by hand: first visits n·T·H·8/8 + H fp16 scales; deltas n·T·H·4/8 + H scales; gradients B·T·H + H scales
            per_micro = B * T * H + 2 * H if step == 0 else B * T * H // 2 + 2 * H
            assert fwd.sent.payload_bytes - before_f[1] == M * per_micro == M * group_nbytes(B, T, H, 8 if step == 0
                                                                                              else 4)
            assert bwd.sent.payload_bytes - before_b[1] == M * (B * T * H + 2 * H)
            assert fwd.sent.wire_bytes - before_f[0] == want_wire
            assert bwd.sent.wire_bytes - before_b[0] == want_grad
            assert s0.aq_out.store.digest() == s1.aq_in.store.digest() == shadow.digest()
        await wait_for(lambda: s1.act_in.recv == fwd.sent and s0.grad_in.recv == bwd.sent, 5, "both ends' counters")
        assert fwd.sent.nacks == bwd.sent.nacks == 0
        assert not any(p.reasons(q) for p in pens for q in peers)


async def test_a_corrupted_version_is_repaired_by_one_nack_and_resend():
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, 2)
        peers = [h.peer_id for h in hosts]
        s0, s1 = hubs[0].open(aq_spec(0, peers)), hubs[1].open(aq_spec(1, peers))
        await aq_step([s0, s1], 0)
        store = s1.aq_in.store
        store.put(3, 7, store.get(3))  # sample 3 (micro-batch 1, row 1): same row, another version
        assert store.digest() != s0.aq_out.store.digest()
        before = s0.act_out.sent.wire_bytes
        got = await aq_step([s0, s1], 1)
        assert s1.aq_in.nacks == 1 and s1.grad_out.sent.nacks == 1  # exactly one NACK ...
        assert s0.aq_out.nacks == 1 and s0.aq_out.resent_rows == 1  # ... of one row, resent once
        assert s0.act_in is None and s0.grad_in.recv.nacks == 1
        assert s0.aq_out.store.digest() == store.digest()
        assert s0.aq_out.store.snapshot() == store.snapshot()
        # the resend: micro-batch 1 again with row 1 at first-visit bits (8) and row 0 as a delta (4)
        sent = s0.act_out.sent.wire_bytes - before
        assert s0.act_out.sent.payload_bytes >= M * group_nbytes(B, T, H, 4) + group_nbytes(1, T, H, 8)
        assert sent > 0 and got["act", 1][0] == ids_of(1)
        await aq_step([s0, s1], 2)
        assert s1.aq_in.nacks == 1 and s0.aq_out.store.digest() == store.digest()
        assert not any(p.reasons(q) for p in pens for q in peers)


# -- hostile neighbours ----------------------------------------------------------------------------------------

def aq_act(step: int, *, first: torch.Tensor | None = None, rows: int = B, **rec) -> bytes:
    """An AQ-SGD activation message of `rows` first visits at 8 bits (or the given hand-made group)."""
    rec = {"step": step, "micro": 0, "kind": "aqsgd", "ids": tuple(range(rows)), "base_versions": (0,) * rows,
           "n_first": rows, "bits": 4, **rec}
    if first is None:
        first = encode_group(acts(step, 0)[:rows], 8)[1]
    return frame(encode_message(Act(**rec))) + frame(first)


def nan_scales(step: int) -> bytes:
    """First visits whose fp16 scales are NaN (a well-formed frame of codec qb)."""
    payload = bytearray(encode_group(acts(step, 0), 8)[1][-(B * T * H + 2 * H):])
    payload[-2:] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    head, body = encode_frame(make_header("qb", "float32", (H, B * T), 8, B * T, 0, payload), payload)
    return bytes(head) + bytes(body)


AQ_FAULTS = {
    "base version from the future": (lambda s: aq_act(s, base_versions=(s + 3, 0), n_first=1,
                                                      first=encode_group(acts(s, 0)[:1], 8)[1])
                                     + frame(encode_group(acts(s, 0)[:1], 4)[1]), "from the future"),
    "id out of range": (lambda s: aq_act(s, ids=(1, 1000)), "sample ids"),
    "wrong group shape": (lambda s: aq_act(s, first=encode_group(acts(s, 0)[:1], 8)[1]), "expected qb 8 bits"),
    "wrong first-visit bits": (lambda s: aq_act(s, first=encode_group(acts(s, 0), 4)[1]), "expected qb 8 bits"),
    "wrong delta bits": (lambda s: aq_act(s, bits=2), "deltas at 2 bits"),
    "NaN rows": (lambda s: frame(encode_message(Act(step=s, micro=0, kind="aqsgd", ids=(0, 1), base_versions=(0, 0),
                                                    n_first=2, bits=4))) + frame(nan_scales(s)), "non-finite"),
    "dense activations": (lambda s: frame(encode_message(Act(step=s, micro=0, kind="fp32", ids=(0, 1)))),
                          "this run sends aqsgd"),
}


async def test_hostile_aq_messages_are_rejected_penalized_and_abort_only_that_step():
    async with AsyncExitStack() as stack:
        lenient = PenaltyConfig(strikes_before_ban=10**6)
        (attacker, victim), pens, hubs = await chain(stack, 2, penalty=lenient)
        peers = [attacker.peer_id, victim.peer_id]
        v = hubs[1].open(aq_spec(1, peers))
        a = hubs[0].open(aq_spec(0, peers))  # the attacker's honest side, for the recovery
        for i, (name, (payload, reason)) in enumerate(AQ_FAULTS.items()):
            step = 2 * i
            outcome: list = []

            async def victim_waits() -> None:
                try:
                    outcome.append(await v.recv_act(step, 0))
                except LinkError as e:
                    outcome.append(e)

            async with trio.open_nursery() as n:
                n.start_soon(victim_waits)
                await wait_for(lambda: v.step == step, 5, "the victim at its step")
                n.start_soon(hostile_dial, attacker, victim.peer_id, {}, payload(step))
                await wait_for(lambda: any(reason in r for r in pens[1].reasons(attacker.peer_id)), 5,
                               f"{name}: the attacker penalized for '{reason}'")
                await wait_for(lambda: outcome, 5, f"{name}: the victim's step aborted")
            assert isinstance(outcome[0], LinkError) and outcome[0].cause == LinkError.VIOLATION, (name, outcome)
            assert len(v.aq_in.store) == 0, name  # nothing hostile reached the store
            # the lane goes on at the next step: the honest side dials afresh
            await a.send_act(step + 1, 0, ids_of(0), acts(step + 1, 0))
            ids, x = await v.recv_act(step + 1, 0)
            assert ids.tolist() == ids_of(0), name
            a.aq_out.commit(step + 1, 0)  # (as the backward's ACK would)
            assert a.aq_out.store.digest() == v.aq_in.store.digest(), name
            v.aq_in.store.clear(), a.aq_out.store.clear()
        # a NACK for rows that went as first visits, on the backward link of an honest sender
        await a.send_act(99, 0, ids_of(0), acts(99, 0))
        stream = await victim.open_stream(attacker.peer_id, "/shoal/lane/1.0.0")
        from shoal.protocol.lane import BWD, LinkHello
        await stream.write(frame(encode_message(LinkHello(run=a.spec.run_id, boundary=0, lane=0, direction=BWD,
                                                          peers=(victim.peer_id, attacker.peer_id)))))
        await stream.write(frame(encode_message(Nack(step=99, micro=0, rows=(0,)))))
        await wait_for(lambda: any("not sent as deltas" in r for r in pens[0].reasons(victim.peer_id)), 5,
                       "the NACKing receiver penalized")


# -- a lane of trainers ----------------------------------------------------------------------------------------

async def train_lane_over_links(m, steps: int, *, check_each_step, buffer_dir=None) -> tuple[list, list]:
    """Every stage of lane 0 as a Trainer on its own host, one step at a time; `check_each_step(ends)` after each."""
    ref_corpus = Trainer(run_manifest(1)).corpus
    async with AsyncExitStack() as stack:
        hosts, pens, hubs = await chain(stack, m.plan.stages)
        peers = [h.peer_id for h in hosts]
        token = trio.lowlevel.current_trio_token()
        stages, ends = [], []
        for s in range(m.plan.stages):
            t = Trainer(m, stage=s, replica=0, boundary=None if m.plan.stages == 1 else object(), corpus=ref_corpus)
            end = hubs[s].open(LaneSpec.from_manifest(
                m, stage=s, lane=0, prev_peer=peers[s - 1] if s else None,
                next_peer=peers[s + 1] if s + 1 < m.plan.stages else None,
                train_samples=t.train_samples.num_samples, eval_samples=t.heldout_samples.num_samples,
                buffer_dir=buffer_dir))
            t.boundary = BlockingLinkEnd(end, token)
            stages.append(t)
            ends.append(end)
        losses = []
        for _ in range(steps):
            results: dict[int, object] = {}

            async def run(s: int) -> None:
                results[s] = await trio.to_thread.run_sync(stages[s].step)

            async with trio.open_nursery() as n:
                for s in range(len(stages)):
                    n.start_soon(run, s)
            losses.append(results[len(stages) - 1].loss)
            check_each_step(ends)
        assert not any(p.reasons(q) for p in pens for q in peers)
        return losses, ends


@pytest.mark.usefixtures("one_torch_thread")
async def test_three_stage_lane_keeps_both_ends_stores_equal_over_epochs_and_trains_like_fp32(tmp_path):
    """S = 3 (the middle stage holds two stores), 16 training samples, 8 per step: 12 epochs in 24 steps; the stores
    in disk files (capped at 1 MiB per link end: 512 rows, more than the 16 samples)."""
    steps = 24
    base = run_manifest(3)
    m = replace(base, data=replace(base.data, train_subset=16), eval=replace(base.eval, every_steps=1000),
                plan=replace(base.plan, pipeline=replace(base.plan.pipeline, buffer="disk", buffer_cap_mb=1)))
    digests: list[list[bytes]] = []
    files: list[int] = []

    def check(ends) -> None:
        pairs = [(ends[s].aq_out.store.digest(), ends[s + 1].aq_in.store.digest()) for s in range(2)]
        assert all(a == b for a, b in pairs), f"step {len(digests)}: digests differ"
        digests.append([a for a, _ in pairs])
        files.append(len(list(tmp_path.glob("*.fp16"))))

    losses, ends = await train_lane_over_links(m, steps, check_each_step=check, buffer_dir=str(tmp_path))
    assert files == [4] * steps  # one file per link end while the lane trains
    assert list(tmp_path.glob("*.fp16")) == []  # and none once the links are closed
    for s in range(2):
        out, inn = ends[s].aq_out, ends[s + 1].aq_in
        assert len(out.store) == 16 and out.store.snapshot() == inn.store.snapshot()
        assert out.nacks == inn.nacks == 0
        sent = ends[s].act_out.sent
        # 2 steps of first visits at 8 bits, then 22 of 4-bit deltas (M = 4 micro-batches of 2 x 32 x 32)
        row, mb = 32 * 32, 4
        assert sent.payload_bytes == (2 * mb * (2 * row + 64) + 22 * mb * (2 * row // 2 + 64)
)
    assert len({d[0] for d in digests}) == steps  # the stores change every step
    ref = Trainer(replace(m, plan=replace(m.plan, stages=1)))
    want = [ref.step().loss for _ in range(steps)]
    tail = slice(steps - 6, steps)
    got_tail, want_tail = sum(losses[tail]) / 6, sum(want[tail]) / 6
    assert abs(got_tail - want_tail) / want_tail < 0.02, (losses, want)


# -- hand-over on churn ----------------------------------------------------------------------------------------

async def test_a_replacement_pulls_the_survivors_store_and_a_link_with_both_ends_new_starts_empty():
    """A (stage 0) and B (stage 1) train 2 steps; B is gone and C takes stage 1 at revision 2: A keeps its store,
    C pulls it (digest checked) and the lane goes on with deltas and no NACK. Then D and E, both new, open a lane
    of their own: nothing to pull, first visits again. A survivor serving a corrupt row is penalized."""
    async with AsyncExitStack() as stack:
        (ha, hb, hc), pens, (a, b, c) = await chain(stack, 3)
        await hc.connect(ha.addrs[0])
        ab = [ha.peer_id, hb.peer_id]
        a0, b1 = a.open(aq_spec(0, ab)), b.open(aq_spec(1, ab))
        for step in (0, 1):
            await aq_step([a0, b1], step)
        digest = a0.aq_out.store.digest()
        assert digest == b1.aq_in.store.digest() and len(a0.aq_out.store) == M * B
        await a0.aclose()
        await b1.aclose()
        ac = [ha.peer_id, hc.peer_id]
        a0, c1 = a.open(aq_spec(0, ac)), c.open(aq_spec(1, ac))
        assert await a0.adopt(2) == 0  # the survivor's store is kept, nothing to pull
        assert a0.aq_out.store.digest() == digest
        assert await c1.adopt(2) == 1
        assert c1.aq_in.store.digest() == digest and c1.aq_in.store.snapshot() == a0.aq_out.store.snapshot()
        assert c.aq_stores.handovers[0]["peer"] == ha.peer_id and c.aq_stores.handovers[0]["rows"] == M * B
        await aq_step([a0, c1], 2)
        assert a0.aq_out.nacks == c1.aq_in.nacks == 0
        assert a0.aq_out.store.digest() == c1.aq_in.store.digest() != digest
        assert a0.act_out.sent.payload_bytes == M * group_nbytes(B, T, H, 4)  # deltas only
        # both ends new: B (stage 0 now) and a fresh C end on lane 1 have no store of lane 1
        bc = [hb.peer_id, hc.peer_id]
        await hb.connect(hc.addrs[0])
        b0, c1b = b.open(aq_spec(0, bc, lane=1)), c.open(aq_spec(1, bc, lane=1))
        assert await b0.adopt(3) == 0 and await c1b.adopt(3) == 0
        assert len(b0.aq_out.store) == len(c1b.aq_in.store) == 0
        await aq_step([b0, c1b], 3)
        assert b0.act_out.sent.payload_bytes == M * group_nbytes(B, T, H, 8)  # first visits
        assert b0.aq_out.store.digest() == c1b.aq_in.store.digest()
        assert not any(p.reasons(q) for p in pens for q in (ha.peer_id, hb.peer_id, hc.peer_id))
        # a survivor whose store holds a non-finite row: the replacement refuses it, penalizes, starts empty
        await c1.aclose()
        c.aq_stores.drop(StoreKey(RUN, 0, 0, "receiver"))  # C leaves the slot and comes back as a new end
        a0.aq_out.store.get(0)[0, 0] = float("nan")  # (corrupted in place, behind the store's back)
        c1 = c.open(aq_spec(1, ac))
        assert await c1.adopt(3) == 0
        assert any("hand-over" in r and "non-finite" in r for r in pens[2].reasons(ha.peer_id))
        assert len(c1.aq_in.store) == 0
