"""CocktailSGD (docs/sync.md): a sharded parameter server over the group, compressed model differences, overlap.

Each replica keeps its parameters x and g, an fp16 copy of the last synchronized parameters that is bitwise equal
on every replica; member c of the round's group serves chunk c of the flattened parameters and keeps that chunk's
server error. A round, for each chunk: the rolling mask of this step, delta = (x - g)[mask] in fp16,
C(delta) = Q_b(TopK_r(delta)) sent to the owner (worker error feedback: x[mask] -= C^(delta)); the owner computes
s = mean C^(delta_i) + e[mask], s_hat = C(s), e[mask] = s - s_hat, and sends s_hat to every member, which adds it
to x[mask] and g[mask].

Overlap (one-step staleness): after optimizer step t the round starts in a background thread on a snapshot of x;
it is joined just before optimizer step t+1, whose gradient was computed on the same x (nothing changes the
parameters in between), and the round's result is written into the parameters then. So communication overlaps the
forward and backward of step t+1, as in the reference. A chunk whose owner's s_hat did not arrive is left
untouched (no worker error feedback either: its delta stays in x - g for a later round).
During the first `warmup_steps` steps gradients are all-reduced and g follows x: uncompressed (the reference's
warm-up), or quantized to `warmup_bits` bits in buckets with worker error feedback (what a replica's quantized
contribution lost is added to its next warm-up gradient), so that the warm-up does not stall a slow link.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from shoal.kernels.cocktail import CocktailCompressor, CocktailConfig
from shoal.kernels.codec import QuantCodec
from shoal.kernels.topk import topk_count
from shoal.node.sync.allreduce import wire_codec
from shoal.node.sync.base import (GroupSync, RoundReport, allreduce_sent, chunk_bounds, decode_tensor, decode_values,
                                  flat_grads, flat_params, fresh_locals, weights_of, write_flat_grads, write_flat_params)
from shoal.node.train.control import StepControl
from shoal.swarm.run.group import Group
from shoal.swarm.state.snapshot import hash_tensor

log = logging.getLogger(__name__)

WARM_BUCKET = 128  # values per fp16 scale of a quantized warm-up gradient


class CocktailSync(GroupSync):
    name = "cocktail"

    def __init__(self, *, cocktail: CocktailConfig = CocktailConfig(), warmup_steps: int = 0,
                 warmup_bits: int = 2, allreduce_dtype: str = "fp32", **kw: Any):
        super().__init__(**kw)
        self.cfg = cocktail
        self.warmup_steps = warmup_steps
        self.codec = wire_codec(allreduce_dtype)
        self.warm_codec = self.codec if warmup_bits == 32 else QuantCodec(warmup_bits, WARM_BUCKET)
        self.warm_e: torch.Tensor | None = None  # fp32, what this replica's quantized warm-up gradients lost
        self.g: torch.Tensor | None = None  # fp16, the synchronized parameters
        self.e: torch.Tensor | None = None  # fp32, server error (only the chunk this replica serves is used)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cocktail-round")
        self._pending: Future | None = None  # the round in flight: (parameters, report)
        self._ready_x: torch.Tensor | None = None
        self._ready_report: RoundReport | None = None

    def _ensure(self, model: torch.nn.Module) -> None:
        self.device = next(model.parameters()).device
        if self.g is None:
            x = flat_params(model)
            self.g, self.e = x.half(), torch.zeros_like(x)
            self.last_hash = hash_tensor(self.g)
        elif self.g.device != self.device:  # loaded from a snapshot (on the CPU)
            self.g, self.e = self.g.to(self.device), self.e.to(self.device)

    def before_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              control: StepControl) -> bool:
        self._ensure(model)
        self._join(model, control)
        step = control.step
        if step < self.warmup_steps:
            report = RoundReport()
            write_flat_grads(model, self._warm_round(flat_grads(model), self.group(control), step, report))
            report.into(control)
        else:
            self.warm_e = None
        return True

    def _warm_round(self, grads: torch.Tensor, group: Group, step: int, report: RoundReport) -> torch.Tensor:
        """The group's mean gradient. Quantized: this replica sends grads + warm_e and keeps what the quantizer
        lost of it (all of a chunk whose owner's mean did not come back) as the next warm_e."""
        codec = self.warm_codec
        if not isinstance(codec, QuantCodec):
            return self.allreduce_mean(grads, codec, group, step, "warm", report)[0]
        if self.warm_e is None or self.warm_e.shape != grads.shape:
            self.warm_e = torch.zeros_like(grads, dtype=torch.float32)
        v = grads.float() + self.warm_e
        mean, covered = self.allreduce_mean(v, codec, group, step, "warm", report)
        self.warm_e = torch.where(covered, v - allreduce_sent(v, codec, group.size), v)
        return mean

    def after_optimizer_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             control: StepControl) -> None:
        self._ensure(model)
        step = control.step
        if step < self.warmup_steps:  # replicas are identical: g is simply the current parameters
            self.g = flat_params(model).half()
            self.last_hash = hash_tensor(self.g)
            return
        group = self.group(control)  # membership is read at the round boundary, in the trainer thread
        self._pending = self._pool.submit(self._round, flat_params(model), group, step)

    def close(self, model: torch.nn.Module, control: StepControl | None = None) -> None:
        self._join(model, control)

    def _wait(self) -> None:
        if self._pending is not None:
            fut, self._pending = self._pending, None
            self._ready_x, self._ready_report = fut.result()

    def _join(self, model: torch.nn.Module, control: StepControl | None) -> None:
        self._wait()
        if self._ready_report is not None:
            self._ready_report.into(control)
            self._ready_report = None
        if self._ready_x is not None:
            write_flat_params(model, self._ready_x)
            self._ready_x = None
            self.rounds += 1
            self.last_hash = hash_tensor(self.g)

    # -- one round (background thread; touches only its snapshot x, g and e) ---------------------------
    def _round(self, x: torch.Tensor, group: Group, step: int) -> tuple[torch.Tensor, RoundReport]:
        report = RoundReport()
        bounds = chunk_bounds(x.numel(), group.size)
        comps = [CocktailCompressor(hi - lo, self.cfg) for lo, hi in bounds]
        live = self.live(group)
        xs, up = {}, {}
        for c, (m, (lo, hi)) in enumerate(zip(group.members, bounds)):
            if m in live:  # a skipped owner's chunk stays as it is: its delta waits in x - g for a later epoch
                xs[c] = x[lo:hi].clone()
                up[m] = comps[c].worker_compress(xs[c], self.g[lo:hi], step)
        lo, hi = bounds[group.rank]
        t0 = self.clock()
        got = self.exchange(group, group.tag(step, "up"), up, live, "up", round_start=t0, phase_no=1,
                            dense_numel=hi - lo)
        # server: aggregate the chunk this replica owns
        comp = comps[group.rank]
        values = self.accept(group.me, got, lambda buf: decode_values(self._decode(buf, comp, "float16"), None), report)
        parts = self.robust_parts(group, values, report)
        s_hat = comp.server_aggregate_values(list(parts.values()), self.e[lo:hi], step,
                                             weights=weights_of(group, parts))
        late = self._late(live, got, report)
        targets = self.live(group)  # all but the members rejected in the up phase (GroupSync._late)
        down = self.exchange(group, group.tag(step, "down"), {m: s_hat for m in targets}, targets, "down",
                             round_start=t0, phase_no=2, dense_numel=hi - lo)
        received, dense = {}, {}
        for c, m in enumerate(group.members):
            if m in down:
                try:
                    received[m] = self._decode(down[m], comps[c], "float32")
                    dense[m] = decode_values(received[m], None)
                except Exception as err:  # noqa: BLE001 - ProtocolError or a kernel's ValueError: the owner's fault
                    self._offend(m, f"broadcast: {err}", report)
        dense = self.accept_broadcasts(group.me, dense, report)
        self.cross_check(group, {m: decode_values(up[m], None) for m in dense if m in up}, dense, report)
        for c, (m, (lo, hi)) in enumerate(zip(group.members, bounds)):
            if m in dense:
                comps[c].worker_apply(xs[c], self.g[lo:hi], step, received[m])
                x[lo:hi] = xs[c]
        self._missing(live - down.keys(), report, late)
        return x, report

    def _decode(self, buf: bytes, comp: CocktailCompressor, dtype: str):
        n = comp.mask(0).count
        k = topk_count(n, self.cfg.r, self.cfg.bucket)
        return decode_tensor(buf, codec="topk", dtype=dtype, numel=n, bits=self.cfg.bits, bucket=self.cfg.bucket,
                             count=k)

    # -- state for checkpoints and joining replicas ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self._wait()  # a round in flight finishes first; its parameters are handed over as pending_x
        return {"g": None if self.g is None else self.g.clone(), "e": None if self.e is None else self.e.clone(),
                "rounds": self.rounds, "pending_x": self._ready_x,
                "warm_e": None if self.warm_e is None else self.warm_e.clone()}

    def enter(self, model: torch.nn.Module) -> None:
        """x = g and no server error: a copy of another replica's x would count its unsent residual twice in the
        group's mean, and the server error belonged to the chunk that replica owned."""
        self._wait()
        self._ready_x = self._ready_report = None
        if self.g is not None:
            write_flat_params(model, self.g.float())
            self.e = torch.zeros_like(self.e) if self.e is not None else None
        self.warm_e = None

    def entry_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """g alone: an entering replica's x is g and its server error zero (`enter`), its optimizer starts afresh
        (another replica's moments follow that replica's own x)."""
        return fresh_locals(state, {"g": state["sync"]["g"], "e": None, "pending_x": None, "warm_e": None})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._wait()
        self.g, self.e = state.get("g"), state.get("e")
        if self.e is None and self.g is not None:  # an entry state: no server error yet
            self.e = torch.zeros_like(self.g, dtype=torch.float32)
        self.rounds = int(state.get("rounds", 0))
        self._ready_x = state.get("pending_x")
        self.warm_e = state.get("warm_e")
        if self.g is not None:
            self.last_hash = hash_tensor(self.g)
