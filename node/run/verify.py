"""A pipeline stage's part in verified stages (docs/verified-stages.md): it keeps the evidence of what crossed its
lane boundaries, serves it to the replicas of its neighbours' stages, and checks the stage it holds in the lane
before its own (in the ring of the table's complete lanes): a random fraction of that lane's micro-batches is
re-executed from the neighbours' signed records with the step's weights (node/train/verify.py) and compared.

A stage found to have sent something else than its computation gave is distrusted here at once (its updates are
left out of what this replica aggregates), reported to the broker, and named to the other replicas of the stage,
which re-execute the same micro-batch themselves and report it too when they agree: the broker evicts it once a
majority of the others has (swarm/run/accusations.py), at an agreed step. Evidence that contradicts itself (two
different tensors signed by one neighbour for one micro-batch) convicts the neighbour that signed both.

Runs on the event loop; the re-execution and the parameter copies run in the trainer's worker thread.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from shoal.node.train.batch import StepBatch
from shoal.node.train.transcript import FIELDS, MicroRecord, Transcript
from shoal.node.train.verify import Check, Evidence, Tolerance, recheck, snapshot_params
from shoal.protocol.assignment import AssignmentTable
from shoal.protocol.lane import BWD, FWD
from shoal.swarm.lane.signing import tensor_digest, tensor_signed_by
from shoal.swarm.net.penalty import Allowance
from shoal.swarm.net.rpc import RpcError

log = logging.getLogger(__name__)

KEEP_STEPS = 3  # steps whose weights and transcripts a stage keeps: a check or a confirmation comes within them
BOOST_FACTOR = 8  # a lane the group statistics point at is checked this many times as often ...
BOOST_STEPS = 16  # ... for this many steps
EVIDENCE_WAIT_S = 10.0  # how long a check waits for the checked lane to finish the step and hold its records
EVIDENCE_PER_MIN = 240  # evidence requests answered per asking peer per minute

Call = Callable[..., Awaitable[Any]]  # (peer, method, body, max_response_bytes) -> answer; raises RpcError


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    step: int
    micro: int
    lane: int
    stage: int
    suspect: str
    why: str  # "forward", "backward", or "equivocation"


@dataclass
class VerifyStats:
    checked: int = 0  # micro-batches re-executed with at least one part compared
    confirmations: int = 0  # re-executions asked by another replica
    findings: list[Finding] = field(default_factory=list)
    skipped: int = 0  # sampled micro-batches whose evidence did not come in time
    seconds: float = 0.0  # re-execution time in the worker thread


def encode_record(rec: MicroRecord | None, sigs: dict[str, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {"sigs": dict(sigs), "t": {}}
    if rec is not None:
        for f, x in rec.tensors().items():
            x = x.detach().contiguous()
            out["t"][f] = [str(x.dtype).removeprefix("torch."), list(x.shape), x.numpy().tobytes()]
    return out


def decode_record(ans: Any, shape: tuple[int, int, int]) -> tuple[MicroRecord, dict[str, bytes]]:
    """A neighbour's evidence answer, strictly: known fields only, the lane's shapes, float32 (int64 ids)."""
    if not isinstance(ans, dict) or not isinstance(ans.get("t"), dict) or not isinstance(ans.get("sigs"), dict):
        raise ValueError("evidence: not a record")
    got: dict[str, torch.Tensor] = {}
    for f, v in ans["t"].items():
        if f not in FIELDS or not (isinstance(v, list) and len(v) == 3 and isinstance(v[2], bytes)):
            raise ValueError(f"evidence: bad field {str(f)[:20]}")
        want = ("int64", [shape[0]]) if f == "ids" else ("float32", list(shape))
        if [v[0], v[1]] != list(want):
            raise ValueError(f"evidence: {f} is {v[0]} {v[1]}, expected {want[0]} {want[1]}")
        dtype = torch.int64 if f == "ids" else torch.float32
        got[f] = torch.frombuffer(bytearray(v[2]), dtype=dtype).reshape(v[1])
    sigs = {k: v for k, v in ans["sigs"].items() if k in FIELDS and isinstance(v, bytes) and len(v) == 64}
    return MicroRecord(**got), sigs


class StageVerifier:
    """One stage node's verification (create once per run; `attach` it to each trainer it holds)."""

    def __init__(self, *, me: str, run_id: str, fraction: float, kind: str, call: Call,
                 penalize: Callable[[str, str], object], weights_hash: Callable[[int], str | None] = lambda step: None,
                 rng: random.Random | None = None, tolerance: Tolerance = Tolerance()):
        self.me, self.run_id, self.fraction, self.kind = me, run_id, fraction, kind
        self.call, self.penalize = call, penalize
        self.weights_hash = weights_hash  # step -> this replica's state hash of the weights it held at that step
        self.rng = rng or random.SystemRandom()  # private: the checked stage cannot predict its samples
        self.tolerance = tolerance
        self.transcript = Transcript(keep_steps=KEEP_STEPS)
        self.params: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # step -> weights at its start
        self.stats = VerifyStats()
        self.signatures: Callable[[int, int], dict[str, bytes]] = lambda step, micro: {}  # the link end's
        self._asked = Allowance(EVIDENCE_PER_MIN, 60.0)
        self._convicted: set[str] = set()
        self._boost: dict[int, int] = {}  # lane -> steps of boosted checks left
        self.boosts = 0  # times the statistics raised a lane's checks

    @property
    def enabled(self) -> bool:
        return self.fraction > 0

    # -- the trainer thread -------------------------------------------------------------------------------------
    def keep_weights(self, trainer, step: int) -> None:
        """Before step `step` runs: a copy of the stage's weights, which every replica of the stage holds too."""
        self.params[step] = snapshot_params(trainer.model)
        while len(self.params) > KEEP_STEPS:
            self.params.popitem(last=False)

    # -- who checks whom ----------------------------------------------------------------------------------------
    @staticmethod
    def monitored_lane(table: AssignmentTable, my_lane: int) -> int | None:
        """The lane whose stage this replica checks: the one before its own in the ring of complete lanes."""
        lanes = list(table.complete_lanes())
        if my_lane not in lanes or len(lanes) < 2:
            return None
        return lanes[lanes.index(my_lane) - 1]

    def draw(self, micro_batches: int, lane: int | None = None) -> list[int]:
        """The micro-batches of one step of `lane` to re-execute: each with probability `fraction` (BOOST_FACTOR
        times it while the statistics point at the lane), privately drawn."""
        p = self.fraction
        if lane is not None and self._boost.get(lane, 0) > 0:
            self._boost[lane] -= 1
            p = min(1.0, BOOST_FACTOR * p)
        return [m for m in range(micro_batches) if self.rng.random() < p]

    def boost(self, lane: int) -> None:
        """The group statistics point at `lane` (a member of it was left out of, or clipped in, a stage group's
        aggregate): check it more often for a while. Cheap, continuous evidence; only a re-execution convicts."""
        if self._boost.get(lane, 0) <= 0:
            self.boosts += 1
        self._boost[lane] = BOOST_STEPS

    # -- evidence -----------------------------------------------------------------------------------------------
    async def rpc_evidence(self, caller: str, body: Any, *, member: Callable[[str], bool]) -> Any:
        """Serve this stage's record of one micro-batch (tensors and the signatures this link end holds) to a
        member of the run."""
        if not member(caller):
            raise PermissionError("evidence is served to the run's members only")
        if not self._asked.take(caller):
            raise PermissionError(f"more than {EVIDENCE_PER_MIN} evidence requests within a minute")
        if not isinstance(body, dict) or not all(isinstance(body.get(k), int) and not isinstance(body.get(k), bool)
                                                 for k in ("step", "micro")):
            raise ValueError("evidence is asked as {step, micro}")
        rec = self.transcript.get(body["step"], body["micro"])
        if rec is None:
            return {"missing": True}
        return encode_record(rec, self.signatures(body["step"], body["micro"]))

    async def _fetch(self, peer: str | None, step: int, micro: int, shape) -> tuple[MicroRecord, dict] | None:
        if peer is None:
            return None
        nbytes = 4 * (shape[0] * shape[1] * shape[2]) * 4 + 64 * 1024
        with trio.move_on_after(EVIDENCE_WAIT_S):
            while True:
                try:
                    ans = await self.call(peer, "run.evidence", {"step": step, "micro": micro},
                                          max_response_bytes=nbytes)
                except RpcError as e:
                    log.info("evidence of step %d #%d from %s: %s", step, micro, peer[-8:], e)
                    return None
                if not (isinstance(ans, dict) and ans.get("missing")):
                    try:
                        return decode_record(ans, shape)
                    except ValueError as e:
                        self.penalize(peer, f"evidence: {e}")
                        return None
                await trio.sleep(0.2)  # the lane has not finished that step yet
        return None

    # -- checking -----------------------------------------------------------------------------------------------
    async def check(self, trainer, table: AssignmentTable, step: int, micro: int, lane: int,
                    confirming: bool = False) -> Finding | None:
        """Re-execute micro-batch `micro` of step `step` of `lane` at this replica's stage; a Finding when its
        stage (or a neighbour that signed two things) is caught."""
        params = self.params.get(step)
        stage = trainer.stage
        prev_p = table.slot_peer(stage - 1, lane) if stage > 0 else None
        x = table.slot_peer(stage, lane)
        next_p = table.slot_peer(stage + 1, lane) if stage + 1 < table.stages else None
        if params is None or x is None or not await self._same_weights(x, step):
            self.stats.skipped += 1
            return None
        shape = (trainer.manifest.batch.micro_batch_size, trainer.manifest.batch.seq_len, trainer.manifest.model.d_model)
        got: dict[str, tuple[MicroRecord, dict] | None] = {}

        async def fetch(name: str, peer: str | None) -> None:
            got[name] = await self._fetch(peer, step, micro, shape)
        async with trio.open_nursery() as n:
            for name, peer in (("prev", prev_p), ("own", x), ("next", next_p)):
                n.start_soon(fetch, name, peer)
        where = dict(run=self.run_id, lane=lane, step=step, micro=micro)
        prev = self._signed(got.get("prev"), {"act_out": (prev_p, stage - 1, FWD), "grad_in": (x, stage - 1, BWD)},
                            where)
        nxt = self._signed(got.get("next"), {"act_in": (x, stage, FWD), "grad_out": (next_p, stage, BWD)}, where)
        own = self._signed(got.get("own"), {"act_in": (prev_p, stage - 1, FWD), "grad_in": (next_p, stage, BWD)},
                           where)
        for a, b, signer in ((own.act_in if own else None, prev.act_out if prev else None, prev_p),
                             (own.grad_in if own else None, nxt.grad_out if nxt else None, next_p)):
            if a is not None and b is not None and tensor_digest(a) != tensor_digest(b):
                return self._found(Finding(step=step, micro=micro, lane=lane, stage=stage, suspect=signer,
                                           why="equivocation"), confirming)
        ev = Evidence(step=step, micro=micro, prev=prev, next=nxt, own=own)
        t0 = trio.current_time()
        share = StepBatch.in_table(trainer.manifest, lane, table).samples  # the checked lane's part of the step
        c: Check = await trio.to_thread.run_sync(recheck, trainer, params, ev, self.kind, self.tolerance, share)
        self.stats.seconds += trio.current_time() - t0
        if not c.checked:
            self.stats.skipped += 1
            return None
        self.stats.checked += 1
        if confirming:
            self.stats.confirmations += 1
        if not c.tampered:
            return None
        why = "forward" if c.forward_ok is False else "backward"
        log.warning("verified stages: stage %d of lane %d (%s) sent other %s values than its computation gives at "
                    "step %d micro-batch %d (largest difference %.3g of the received magnitude)", stage, lane,
                    x[-8:], "activations" if why == "forward" else "gradients", step, micro,
                    c.forward_err if why == "forward" else c.backward_err)
        return self._found(Finding(step=step, micro=micro, lane=lane, stage=stage, suspect=x, why=why), confirming)

    async def _same_weights(self, peer: str, step: int) -> bool:
        """Whether `peer` held the weights this replica held at `step` (their state hashes agree): only then is a
        re-execution comparable. Replicas that drifted apart are the hash vote's to settle (node/run/votes.py),
        and a member that answers otherwise than it published is caught there."""
        if step == 0:
            return True  # every replica starts from the run's initialisation
        mine = self.weights_hash(step)
        if not mine:
            return False
        try:
            ans = await self.call(peer, "run.hash_at", step, max_response_bytes=4096)
        except RpcError:
            return False
        return isinstance(ans, dict) and ans.get("hash") == mine

    def _signed(self, got, expected: dict[str, tuple[str | None, int, str]], where: dict) -> MicroRecord | None:
        """The record with only the tensors that carry their sender's valid signature (`expected`: field ->
        (signer, boundary, direction)); a provider whose evidence is badly signed is penalized."""
        if got is None:
            return None
        rec, sigs = got
        keep: dict[str, torch.Tensor] = {"ids": rec.ids} if rec.ids is not None else {}
        ids = tuple(rec.ids.tolist()) if rec.ids is not None else ()
        for f, (signer, boundary, direction) in expected.items():
            x = getattr(rec, f)
            if x is None or signer is None:
                continue
            if tensor_signed_by(signer, sigs.get(f, b""), x, boundary=boundary, direction=direction,
                                ids=ids if direction == FWD else (), **where):
                keep[f] = x
            else:
                log.info("evidence of step %d #%d: %s not signed by %s", where["step"], where["micro"], f, signer[-8:])
        return MicroRecord(**keep)

    def _found(self, f: Finding, confirming: bool) -> Finding:
        self.stats.findings.append(f)
        if f.suspect not in self._convicted:
            self._convicted.add(f.suspect)
            self.penalize(f.suspect, f"verified stages: {f.why} of step {f.step} #{f.micro} (lane {f.lane}, stage "
                                     f"{f.stage}) is not its computation's")
        return f
