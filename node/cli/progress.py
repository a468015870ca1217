"""What `shoal node` prints while it runs: start-up progress as it happens, then a status line every few seconds
(role, slot, step, loss, tokens/s, peers, bytes sent and compression), all from the node's own published view."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from shoal.node.failure import one_line
from shoal.protocol.display import nbytes, short_id, si
from shoal.protocol.records import RunStatus

POLL_S = 0.25  # start-up progress is checked this often
UNCHANGED_EVERY_S = 60.0  # a status line that says nothing new is printed at most this often
EVENT_WORDS = {"join": "joined", "left": "left", "gone": "is gone", "back": "is back"}
WAITING_TEXT = ("no run of this swarm takes this node yet: waiting for one (it joins the swarm's open run when there "
                "is exactly one; --run NAME chooses one, --no-train only joins the swarm)")


def _run_members(node: Any, run_id: str | None) -> int:
    """Peers of this node's run that hold a slot, by their status records (this node not included)."""
    if run_id is None or node.membership is None:
        return 0
    return sum(1 for e in node.membership.live_peers()
               if e.status_record is not None and e.status_record.run_id == run_id and e.status_record.slot)


def run_status(node: Any) -> RunStatus:
    rt = node.runtime
    return rt.status() if rt is not None else RunStatus()


def startup_text(node: Any) -> str | None:
    """What start-up is doing now (None once the node is up and, with a run, training or waiting as a backup)."""
    if node.state != "ready":
        return f"{node.phase}…" if node.phase not in ("starting", "ready") else None
    rt = node.runtime
    if rt is None:
        return None
    f = run_status(node)
    run = f"run {f.run_id[:8]}…" if f.run_id else "run"
    state, role, slot = f.state, f.role, f.slot
    if rt.manifest is None:
        if rt.finder.waiting:
            return None  # up and idle: status lines say it waits (WAITING_TEXT once)
        if rt.config.select is not None:
            return "looking for the run to join among the swarm's runs…"
        return "joining the run: fetching its manifest…"
    if state == "joining" and not slot and role in (None, "idle"):
        return f"joining {run}: asking its broker for a place…"
    if state == "joining" and f.step is None:
        return f"joining {run} as {slot or role}: loading the corpus and building the model…"
    if state == "joining":
        return f"joining {run} as {slot}: pulling the group's state…"
    if state == "ready" and slot and not f.step:
        have = 1 + _run_members(node, f.run_id)
        return f"{run}: waiting for the group to fill, {have}/{rt.manifest.plan.replicas} replicas"
    if state == "waiting":
        return (f"{run}: fewer replicas than the run's minimum of {rt.manifest.plan.lanes_min}: waiting for "
                f"volunteers")
    return None


def describe_run(m: Any, device: str, free_bytes: int | None) -> str:
    """The run's model, the device it trains on, and the memory its stage needs vs what is free there."""
    from shoal.node.run.preflight import stage_need

    need = stage_need(m, device)
    free = f", {nbytes(free_bytes)} free" if free_bytes is not None else ""
    p = m.plan
    lanes = f"{p.replicas} to {p.lanes_max} replicas" if p.elastic else f"{p.replicas} replicas"
    return (f"run {m.run_id[:8]}…: {m.model.describe()} ({need.params / 1e6:.1f}M params), {lanes} with "
            f"{p.sync.method}, {m.global_batch} sequences a step; training on {device}: needs "
            f"~{nbytes(need.total_bytes)}{free}")


def status_line(node: Any, now: float | None = None) -> str:
    """One line: role and slot, step, loss, tokens/s, peers, bytes sent and the compression ratio."""
    now = time.time() if now is None else now
    peers = len(node.membership.live_peers()) if node.membership is not None else 0
    f = run_status(node)
    role = f.role or node.role
    parts = [time.strftime("%H:%M:%S", time.localtime(now)), f"{role} {f.slot}" if f.slot else role]
    finding = node.runtime is not None and node.runtime.manifest is None
    if node.runtime is not None and not finding:
        parts.append(str(f.state or "joining"))
        if f.step is not None:
            total = node.runtime.manifest.optim.total_steps if node.runtime.manifest is not None else None
            limit = node.runtime.config.max_steps or total
            parts.append(f"step {f.step}" + (f"/{limit}" if limit else ""))
        if f.loss is not None:
            parts.append(f"loss {f.loss:.3f}")
        if f.tokens_per_s:
            parts.append(f"{si(f.tokens_per_s, digits=2)} tok/s")
        if f.tokens_done:
            parts.append(f"contributed {si(f.samples_done or 0, digits=2)} seq ({si(f.tokens_done, digits=2)} tok)")
    parts.append(f"{peers} peer{'s' if peers != 1 else ''}")
    if f.bytes_sent is not None:
        ratio = f.compression_ratio
        parts.append(f"sent {nbytes(f.bytes_sent)}" + (f" ({ratio:.1f}x incl. warm-up)" if ratio else ""))
    if f.error:
        parts.append(f"error: {f.error}")
    if finding:
        parts.append("waiting for a run to join" if node.runtime.finder.waiting else "looking for the run to join")
    return " · ".join(parts)


async def print_progress(node: Any, every_s: float, say: Callable[[str], None], *, device: str | None = None,
                         free_bytes: int | None = None, announced: trio.Event | None = None) -> None:
    """Start-up progress and peers joining or leaving as they happen, then `status_line` every `every_s` (at most
    every UNCHANGED_EVERY_S while it says nothing new), the first once `announced` is set (the caller has said how
    others join this node: no status line comes before it). With `device`, the run's description once its manifest
    arrives from the swarm (a run joined by id)."""
    last_text, described, next_line, events_seen, said_waiting = None, device is None, 0.0, 0, False
    last_line, last_line_at = "", -UNCHANGED_EVERY_S
    while True:
        if not described and node.runtime is not None and node.runtime.manifest is not None:
            rt = node.runtime
            why = f" ({rt.finder.reason})" if rt.finder.reason else ""
            say(f"run '{rt.manifest.name}'{why}")
            say(describe_run(rt.manifest, device, free_bytes))
            described = True
        text = startup_text(node)
        if text is not None and text != last_text:
            say(text)
        if not said_waiting and node.runtime is not None and node.runtime.finder.waiting:
            say(WAITING_TEXT)
            said_waiting = True
        last_text = text
        for _, ev in node.events[events_seen:]:
            say(f"peer {short_id(ev.peer_id)} {EVENT_WORDS.get(ev.kind, ev.kind)}"  # a leave reason is the peer's
                + (f" ({one_line(ev.detail)})" if ev.detail and ev.kind != "join" else ""))  # text: one line
        events_seen = len(node.events)
        now = trio.current_time()
        up = node.state == "ready" and (announced is None or announced.is_set())
        if up and text is None and every_s > 0 and now >= next_line:
            line = status_line(node)
            body = line.split(" · ", 1)[-1]  # without the time
            if body != last_line or now - last_line_at >= UNCHANGED_EVERY_S:
                say(line)
                last_line, last_line_at = body, now
            next_line = now + every_s
        await trio.sleep(POLL_S)
