"""The dashboard's data layer: a pure-Python view of the swarm built from fed records and a clock passed in.

Nothing here imports Textual. `SwarmView.feed(record, now)` folds one verified record into the view and
returns the events it caused; `SwarmView.tick(now)` derives stale/gone transitions from silence;
`SwarmView.summary(now)` gives the aggregates the Overview shows. A new record kind plugs in with
`SwarmView.register(RecordType)` on a handler method.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shoal.protocol.display import short_id  # noqa: F401 - the one abbreviation, re-exported for the panes
from shoal.protocol.display import si
from shoal.protocol.manifest import RunManifest
from shoal.protocol.records import Announcement, LeaveNotice, StatusRecord


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewConfig:
    stale_after_s: float = 6.0  # ~3 status intervals of silence: the peer is shown as stale
    gone_after_s: float = 15.0  # this long silent: gone (no longer counted)
    run_id: str | None = None  # follow only this run (peers reporting another run are ignored)
    loss_points: int = 2000  # steps of loss history kept for the plot
    max_events: int = 1000
    errors_per_peer: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.stale_after_s < self.gone_after_s:
            raise ValueError(f"need 0 < stale_after_s ({self.stale_after_s}) < gone_after_s ({self.gone_after_s})")
        if self.loss_points < 2 or self.max_events < 1 or self.errors_per_peer < 1:
            raise ValueError("loss_points >= 2, max_events >= 1 and errors_per_peer >= 1 are needed")


class Liveness(enum.StrEnum):
    LIVE = "live"
    STALE = "stale"  # silent for stale_after_s
    GONE = "gone"  # silent for gone_after_s
    LEFT = "left"  # sent a leave notice


class EventKind(enum.StrEnum):
    JOIN = "join"
    BACK = "back"  # a stale/gone/left peer reports again
    LEAVE = "leave"
    STALE = "stale"
    GONE = "gone"
    PROMOTION = "promotion"  # backup -> active
    BROKER = "broker"  # the peer holding the broker role changed
    ERROR = "error"  # a status record's error field appeared or changed
    RECOVERY = "recovery"  # a lost stage rebuilt (from shards or a disk checkpoint) and the run rolled back
    BAN = "ban"  # reserved for ban records (a later record kind)


@dataclass(frozen=True, slots=True)
class Event:
    time: float  # local clock (unix s) when the dashboard saw it
    kind: EventKind
    peer_id: str | None
    text: str


@dataclass(slots=True)
class PeerView:
    """Everything the dashboard knows about one peer."""

    peer_id: str
    first_seen: float
    last_seen: float  # local clock of the last record from this peer
    announcement: Announcement | None = None
    status: StatusRecord | None = None
    left: LeaveNotice | None = None
    errors: deque[tuple[float, str]] = field(default_factory=deque)  # (local time, text), newest last
    liveness: Liveness = Liveness.LIVE  # as of the last tick/feed
    # AQ-SGD link ends: (link, side) -> {step: digest} of the last few steps published, and each end's verdict
    # against its other end at a step both published: "agrees", "differs" or "pending"
    link_digests: dict[tuple[str, str], dict[int, str]] = field(default_factory=dict)
    link_verdicts: dict[tuple[str, str], str] = field(default_factory=dict)
    # the steps whose training / held-out loss this peer already added to the view's history (each counted once,
    # however many records repeat it)
    counted: set[int] = field(default_factory=set)
    counted_evals: set[int] = field(default_factory=set)
    last_eval: float | None = None  # the held-out loss its last record gave (for records without an eval history)

    @property
    def is_observer(self) -> bool:
        return bool((self.announcement and self.announcement.observer) or (self.status and self.status.role == "observer"))

    @property
    def role(self) -> str:
        return self.status.role if self.status else "idle"

    def liveness_at(self, now: float, cfg: ViewConfig) -> Liveness:
        if self.left is not None:
            return Liveness.LEFT
        silent = now - self.last_seen
        if silent >= cfg.gone_after_s:
            return Liveness.GONE
        if silent >= cfg.stale_after_s:
            return Liveness.STALE
        return Liveness.LIVE


@dataclass(frozen=True, slots=True)
class LossPoint:
    step: int
    loss: float | None  # mean over peers reporting this step
    eval_loss: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    run_id: str | None
    model: str | None  # the run's model and size, once its manifest is known
    plan: str | None  # its stages, replicas (lanes) and synchronizer
    global_step: int
    tokens_per_s: float
    active: int
    backup: int
    idle: int
    stale: int
    gone: int  # gone or left
    broker: str | None
    wire_bytes_per_s: float  # sum of live peers' upload rates, synchronization and lane links (each byte counted
    #                          once, at its sender)
    uncompressed_bytes_per_s: float  # what the same tensors would take uncompressed (fp32)
    last_loss: float | None
    last_eval_loss: float | None

    @property
    def compression(self) -> float | None:
        """Live effective ratio uncompressed / on the wire (None while nothing is sent)."""
        return self.uncompressed_bytes_per_s / self.wire_bytes_per_s if self.wire_bytes_per_s > 0 else None


Handler = Callable[["SwarmView", Any, float], None]


class SwarmView:
    """Peers, aggregates, loss history and events, from records and an explicit clock (`now`, unix s)."""

    HANDLERS: ClassVar[dict[type, Handler]] = {}

    @classmethod
    def register(cls, record_type: type) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            cls.HANDLERS[record_type] = fn
            return fn

        return deco

    def __init__(self, config: ViewConfig | None = None) -> None:
        self.config = config or ViewConfig()
        self.peers: dict[str, PeerView] = {}
        self.events: deque[Event] = deque(maxlen=self.config.max_events)
        self.broker: str | None = None
        self.model: str | None = None
        self.plan: str | None = None
        self.manifest: RunManifest | None = None
        self.run_id: str | None = self.config.run_id
        self._loss: dict[int, list[float]] = {}
        self._eval: dict[int, list[float]] = {}
        self._max_step = 0
        self.records_seen = 0
        self.records_ignored = 0
        self._pending: list[Event] = []  # events of the feed/tick in progress
        self._heard_at: float | None = None  # when the record being fed was heard from its peer

    # --- feeding -------------------------------------------------------------------------------

    def feed(self, record: Any, now: float, age_s: float = 0.0) -> list[Event]:
        """Fold one record into the view; returns the new events (also appended to `events`). `age_s`: how old the
        record was when it arrived (a members snapshot's rows): it counts as heard from its peer that long ago."""
        handler = self.HANDLERS.get(type(record))
        if handler is None:
            self.records_ignored += 1
            return []
        self.records_seen += 1
        self._pending = []
        self._heard_at = now - max(0.0, age_s)
        try:
            handler(self, record, now)
        finally:
            self._heard_at = None
        return self._pending

    def _emit(self, now: float, kind: EventKind, peer_id: str | None, text: str) -> None:
        ev = Event(now, kind, peer_id, text)
        self.events.append(ev)
        self._pending.append(ev)

    def _touch(self, peer_id: str, now: float) -> PeerView:
        """The peer's entry, marking it heard from when the record being fed was (now, unless it came old); emits
        join/back events. An old record (a snapshot's row: a peer's last record from before it went silent) is not
        news of the peer: it does not bring it "back"."""
        heard = min(now, self._heard_at if self._heard_at is not None else now)
        p = self.peers.get(peer_id)
        if p is None:
            p = self.peers[peer_id] = PeerView(peer_id=peer_id, first_seen=now, last_seen=heard)
            self._emit(now, EventKind.JOIN, peer_id, "joined the swarm")
            return p
        was = p.liveness  # as of the last tick, so a "back" always follows a "stale"/"gone"/"leave" event
        p.last_seen = max(p.last_seen, heard)
        if now - heard >= self.config.stale_after_s:
            return p  # old news: liveness stays what silence made it
        p.left = None
        if was is not Liveness.LIVE:
            self._emit(now, EventKind.BACK, peer_id, f"reports again (was {was.value})")
        p.liveness = Liveness.LIVE
        return p

    def _set_broker(self, peer_id: str | None, now: float, why: str) -> None:
        if peer_id == self.broker:
            return
        old = self.broker
        self.broker = peer_id
        if peer_id is None:
            self._emit(now, EventKind.BROKER, old, f"no broker: {short_id(old or '?')} {why}")
        else:
            was = f" (was {short_id(old)})" if old else ""
            self._emit(now, EventKind.BROKER, peer_id, f"is now the broker{was}")

    # --- aggregates ----------------------------------------------------------------------------

    def tick(self, now: float) -> list[Event]:
        """Re-derive each peer's liveness at `now`; returns stale/gone events for transitions."""
        self._pending = []
        for p in self.peers.values():
            new = p.liveness_at(now, self.config)
            if new is p.liveness:
                continue
            if new is Liveness.STALE and p.liveness is Liveness.LIVE:
                self._emit(now, EventKind.STALE, p.peer_id, f"silent for {now - p.last_seen:.0f} s")
            elif new is Liveness.GONE:
                self._emit(now, EventKind.GONE, p.peer_id, f"silent for {now - p.last_seen:.0f} s: gone")
                if self.broker == p.peer_id:
                    self._set_broker(None, now, "is gone")
            p.liveness = new
        return self._pending

    def counted_peers(self) -> list[PeerView]:
        return [p for p in self.peers.values() if not p.is_observer]

    def present_peers(self, now: float) -> list[PeerView]:
        """The counted peers that are still there (live or stale; not gone, not left)."""
        return [p for p in self.counted_peers()
                if p.liveness_at(now, self.config) not in (Liveness.GONE, Liveness.LEFT)]

    def summary(self, now: float) -> Summary:
        cfg = self.config
        counts = {"active": 0, "backup": 0, "idle": 0, "stale": 0, "gone": 0}
        step = None
        tps = wire = raw = 0.0
        for p in self.counted_peers():
            lv = p.liveness_at(now, cfg)
            if lv in (Liveness.GONE, Liveness.LEFT):
                counts["gone"] += 1
                continue
            s = p.status
            if lv is Liveness.STALE:
                counts["stale"] += 1
            elif p.role in ("active", "broker"):
                counts["active"] += 1
            elif p.role == "backup":
                counts["backup"] += 1
            else:
                counts["idle"] += 1
            if s is None:
                continue
            if s.role == "active":
                step = s.step if step is None else max(step, s.step)
            if lv is Liveness.LIVE:
                tps += s.tokens_per_s
                wire += s.up_bytes_per_s
                raw += s.up_bytes_per_s * ratio_of(s)
        last = self.loss_history()[-1:] or [LossPoint(0, None, None)]
        last_eval = next((pt.eval_loss for pt in reversed(self.loss_history()) if pt.eval_loss is not None), None)
        return Summary(
            run_id=self.run_id,
            model=self.model,
            plan=self.plan,
            global_step=self._max_step if step is None else step,
            tokens_per_s=tps,
            active=counts["active"],
            backup=counts["backup"],
            idle=counts["idle"],
            stale=counts["stale"],
            gone=counts["gone"],
            broker=self.broker,
            wire_bytes_per_s=wire,
            uncompressed_bytes_per_s=raw,
            last_loss=last[0].loss,
            last_eval_loss=last_eval,
        )

    def loss_history(self) -> list[LossPoint]:
        steps = sorted(set(self._loss) | set(self._eval))
        return [
            LossPoint(s, _mean(self._loss.get(s)), _mean(self._eval.get(s)))
            for s in steps
        ]

    def _add_loss(self, p: PeerView, s: StatusRecord) -> None:
        """This peer's training loss at its step, and the points of its history (steps before this dashboard
        started too) and its held-out evaluations at the steps they were taken, each step counted once per peer.
        A record without a history (an older node) gives its held-out loss when it changes."""
        points = s.history() + ([(s.step, s.loss)] if s.loss is not None else [])
        evals = s.evals()
        if not s.eval_steps and s.eval_loss is not None and (not p.counted_evals or s.eval_loss != p.last_eval):
            evals = [(s.step, s.eval_loss)]
        for pts, table, seen in ((points, self._loss, p.counted), (evals, self._eval, p.counted_evals)):
            for step, value in pts:
                if step in seen or (table and len(table) >= self.config.loss_points and step < min(table)):
                    continue
                seen.add(step)
                vals = table.setdefault(step, [])
                if len(vals) < 64:
                    vals.append(value)
                while len(table) > self.config.loss_points:
                    del table[min(table)]
            if len(seen) > 2 * self.config.loss_points:  # forget what fell off the history
                low = min(table) if table else 0
                seen.difference_update([x for x in seen if x < low])
        if s.eval_loss is not None:
            p.last_eval = s.eval_loss


# --- handlers, one per record kind ----------------------------------------------------------------


@SwarmView.register(Announcement)
def _on_announcement(view: SwarmView, a: Announcement, now: float) -> None:
    p = view._touch(a.peer_id, now)
    p.announcement = a


@SwarmView.register(StatusRecord)
def _on_status(view: SwarmView, s: StatusRecord, now: float) -> None:
    if view.config.run_id is not None and s.run_id is not None and s.run_id != view.config.run_id:
        view.records_ignored += 1
        return
    old = view.peers.get(s.peer_id)
    if old is not None and old.status is not None and s.seq <= old.status.seq:
        return  # older or repeated: ignored
    if old is not None and old.left is not None and s.time <= old.left.time:
        return  # a status overtaken by its own leave notice
    p = view._touch(s.peer_id, now)
    prev = p.status
    p.status = s
    if prev is not None and prev.role == "backup" and s.role == "active":
        where = f" into slot {s.slot}" if s.slot else ""
        view._emit(now, EventKind.PROMOTION, s.peer_id, f"promoted from the backup pool{where}")
    if s.role == "broker":
        view._set_broker(s.peer_id, now, "")
    elif view.broker == s.peer_id:
        view._set_broker(None, now, f"is now {s.role}")
    if s.recovery and (prev is None or prev.recovery != s.recovery):
        view._emit(now, EventKind.RECOVERY, s.peer_id, s.recovery)
    if s.error and (prev is None or prev.error != s.error):
        p.errors.append((now, s.error))
        while len(p.errors) > view.config.errors_per_peer:
            p.errors.popleft()
        view._emit(now, EventKind.ERROR, s.peer_id, s.error)
    if s.run_id and view.run_id is None:
        view.run_id = s.run_id
    if s.role == "active":
        view._max_step = max(view._max_step, s.step)
    if s.role in ("active", "broker"):
        view._add_loss(p, s)
    _on_links(view, p, s)


LINK_HISTORY = 16  # steps of digests kept per link end (each record brings its step and its checkpoint steps)
OTHER_SIDE = {"sender": "receiver", "receiver": "sender"}


def _on_links(view: SwarmView, p: PeerView, s: StatusRecord) -> None:
    """Fold a status's AQ-SGD link digests in and judge this peer's link ends and their other ends again."""
    ends = {(x.link, x.side) for x in s.lane_links}
    p.link_digests = {k: v for k, v in p.link_digests.items() if k in ends}
    p.link_verdicts = {k: v for k, v in p.link_verdicts.items() if k in ends}
    for x in s.lane_links:
        if x.compression != "aqsgd" or x.step is None:
            continue
        hist = p.link_digests.setdefault((x.link, x.side), {})
        hist.update(zip(x.check_steps, x.check_digests))  # checkpoints: steps the other end publishes too
        hist[x.step] = x.digest
        for old in sorted(hist)[:-LINK_HISTORY]:
            del hist[old]
        other = view.peers.get(x.peer)
        p.link_verdicts[x.link, x.side] = _verdict(hist, other, x.link, OTHER_SIDE[x.side])
        if other is not None and (x.link, OTHER_SIDE[x.side]) in other.link_digests:
            other.link_verdicts[x.link, OTHER_SIDE[x.side]] = _verdict(
                other.link_digests[x.link, OTHER_SIDE[x.side]], p, x.link, x.side)


def _verdict(mine: dict[int, str], other: PeerView | None, link: str, side: str) -> str:
    theirs = other.link_digests.get((link, side), {}) if other is not None else {}
    common = set(mine) & set(theirs)
    if not common:
        return "pending"
    step = max(common)
    return "agrees" if mine[step] == theirs[step] else "differs"


def links_mark(p: PeerView) -> str:
    """A short mark of a stage's AQ-SGD links for the peers table: "aq✓" all agree, "aq✗" one differs, "aq…"
    not judged yet; "" without AQ-SGD links."""
    v = set(p.link_verdicts.values())
    if not v:
        return ""
    return "aq✗" if "differs" in v else "aq…" if "pending" in v else "aq✓"


@SwarmView.register(RunManifest)
def _on_manifest(view: SwarmView, m: RunManifest, now: float) -> None:
    """The run's manifest (fetched from a peer by the observer and checked against its run id): the Model row."""
    if view.run_id is not None and m.run_id != view.run_id:
        view.records_ignored += 1
        return
    view.manifest = m
    view.run_id = m.run_id
    view.model, view.plan = describe_run(m)


def describe_run(m: RunManifest) -> tuple[str, str]:
    """("tiny GPT · 0.4M params", "2 stages × 2 lanes · cocktail") of a run's manifest."""
    params = sum(m.stage_params(s) for s in range(m.plan.stages))
    model = f"{m.model.size} GPT · {si(params)} params"
    plan = m.plan
    shape = (f"{plan.stages} stages × {plan.replicas} lane{'s' if plan.replicas != 1 else ''}" if plan.stages > 1
             else f"{plan.replicas} replica{'s' if plan.replicas != 1 else ''}")
    return model, f"{shape} · {plan.sync.method}"


def ratio_of(s: StatusRecord) -> float:
    """A status's compression ratio over its recent window (the synchronizer's since its start from an older node)."""
    return s.ratio_now or s.compression_ratio or 1.0


@SwarmView.register(LeaveNotice)
def _on_leave(view: SwarmView, n: LeaveNotice, now: float) -> None:
    p = view.peers.get(n.peer_id)
    if p is None:
        p = view.peers[n.peer_id] = PeerView(peer_id=n.peer_id, first_seen=now, last_seen=now)
    if p.left is not None:
        return
    p.left = n
    p.last_seen = max(p.last_seen, now)
    p.liveness = Liveness.LEFT
    reason = f": {n.reason}" if n.reason else ""
    view._emit(now, EventKind.LEAVE, n.peer_id, f"left{reason}")
    if view.broker == n.peer_id:
        view._set_broker(None, now, "left")


# --- helpers --------------------------------------------------------------------------------------


def _mean(vals: list[float] | None) -> float | None:
    return sum(vals) / len(vals) if vals else None
