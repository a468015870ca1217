"""What a training node publishes about its run (node/run/runtime.py `RunRuntime`, read as it is at that moment):
its status record's run fields and its status file's details."""

from __future__ import annotations

import math
from typing import Any

from shoal.node.run.status import RunDetail
from shoal.protocol.records import RunStatus


def run_status(rt: Any) -> RunStatus:
    """What this node's status record says about the run (checked as it is built)."""
    if rt.manifest is None:
        return RunStatus(state="ready")  # idle while it looks for the run to join
    c, r = rt.client, rt.replica
    t, s, last = r.trainer, r.sync, r.last
    loss = last.loss if t is not None and last is not None else None  # None at a stage that is not the last
    loss = loss if loss is not None and math.isfinite(loss) else None
    if t is not None:  # the history is sampled as the status is taken (reading a loss waits for the GPU's step)
        r.sample_history(loss)
    link_bytes = rt.links.total_bytes() if rt.links is not None else None
    up = down = ratio_now = state_hash = None
    if s is not None:
        hashes = rt.consistency.hashes.hashes
        # the hash recorded with the step published (once done, the final state's)
        state_hash = hashes[max(hashes)] if r.state == "done" and hashes else rt.consistency.published(r.at_step)
        # the byte rates count the lane links' bytes too, and the ratio is over the same window on every node
        link_sent, link_recv, link_fp32 = rt.links.bytes() if rt.links is not None else (0, 0, 0)
        up, down, ratio_now = r.throughput.rates(rt.clock(), s.bytes_sent + link_sent,
                                                 s.bytes_recv + link_recv, s.fp32_bytes + link_fp32)
    return RunStatus(
        run_id=rt.manifest.run_id, state=r.state,
        role=None if c is None else "broker" if c.is_broker() else c.role(),  # the broker may hold a slot too
        slot=None if c is None else c.slot_name(), warm_stage=None if c is None else c.backup_stage(),
        step=r.at_step if t is not None else None,
        loss=loss,
        tokens_per_s=round(r.throughput.tokens_per_s(last.tokens_per_s), 1)
        if t is not None and last is not None else None,
        eval_loss=t.last_eval_loss if t is not None else None,
        link_bytes_sent=link_bytes[0] if link_bytes is not None else None,
        link_bytes_recv=link_bytes[1] if link_bytes is not None else None,
        lane_links=rt.links.statuses() if rt.links is not None else None,
        bytes_sent=s.bytes_sent if s is not None else None, bytes_recv=s.bytes_recv if s is not None else None,
        up_bytes_per_s=up, down_bytes_per_s=down,
        compression_ratio=round(s.compression_ratio, 2) if s is not None else None, ratio_now=ratio_now,
        state_hash=state_hash or None,
        error="evicted from the run: most of its group rejected its updates" if c is not None and c.evicted()
        else rt.error[:200] if rt.error else None,
        samples_per_s=round(t.speed.rate(), 3) if t is not None else None, **rt.contribution.fields(),
        **(r.history_fields() if t is not None else {}), **_recovery_status(rt))


def _recovery_status(rt: Any) -> dict[str, Any]:
    rec = rt.recovery
    if rec is None:
        return {}
    return {"shards": tuple(rec.shards.holdings()), "shards_placed": rec.shards.placed, "recovery": rec.notice}


def run_detail(rt: Any) -> RunDetail:
    """What the node's status file adds about the run."""
    links = rt.links
    return RunDetail(refetches=rt.consistency.refetches,
                     entries=tuple(rt.entry.entries[-4:]) if rt.entry is not None else (),
                     recent_hashes=dict(sorted(rt.consistency.hashes.hashes.items())[-16:]),
                     recent_samples=dict(sorted(rt.step_samples.items())[-16:]),
                     warm_revision=rt.warm.revision if rt.warm is not None else None,
                     links=links.counters() if links is not None else {},
                     recent_link_digests=links.recent_digests() if links is not None else {},
                     verified=_verified_detail(rt))


def _verified_detail(rt: Any) -> dict[str, Any] | None:
    """A verified run's stage: what it re-executed and found (None: not a verified run)."""
    v = rt.verified.verifier if rt.verified is not None else None
    if v is None or not v.enabled:
        return None
    return {"checked": v.stats.checked, "skipped": v.stats.skipped, "confirmations": v.stats.confirmations,
            "findings": [[f.step, f.micro, f.lane, f.stage, f.suspect, f.why] for f in v.stats.findings[-16:]]}
