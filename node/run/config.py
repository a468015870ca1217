"""A node's settings for taking part in a run (parsed once at the command line, frozen below it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.node.defaults import BACKUP_REFRESH_S, ROUND_TIMEOUT_S
from shoal.protocol.manifest import RunManifest
from shoal.swarm.run.broker import BrokerConfig
from shoal.swarm.run.client import RunClientConfig
from shoal.swarm.run.replan import ReplanConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    manifest: RunManifest | None = None  # None: fetched from the joined peers by `run_id`, or found by `select`
    run_id: str | None = None
    # a run found among the swarm's advertised runs (node/run/resolve.py): its name or an id prefix; "": the one run
    # of the swarm this node may join
    select: str | None = None
    secret: str | None = None
    device: str = "cpu"  # a resolved device (cpu, cuda, cuda:N, mps), not auto
    device_free_bytes: int | None = None  # its free memory at start (None: not checked), see run/preflight.py
    threads: int | None = None  # torch threads for the trainer (None: torch's default)
    data: str | None = None  # the volunteer's --data: a local corpus for a run whose manifest names a local path
    max_steps: int | None = None  # stop training after this many steps (None: the manifest's total)
    switch_lead_s: float = 2.0  # group changes take effect this far ahead (time for the table to reach everyone)
    switch_lead_min_steps: int = 3
    start_wait_s: float = 60.0  # a new run waits this long for its group to fill before step 0
    backup_refresh_s: float = BACKUP_REFRESH_S  # backups refresh their warm copy this often
    round_timeout_s: float = ROUND_TIMEOUT_S
    state_pull_timeout_s: float = 120.0  # entering a group: how long to keep trying to pull its state
    state_pull_attempt_s: float = 30.0  # ... and how long one attempt from one peer may take
    final_check_s: float = 60.0  # at the end, how long to wait for the group's final hashes
    leave_timeout_s: float = 3.0  # a leave notice to the broker gives up after this long
    snapshot_every_steps: int = 50  # besides the steps joiners need, a fresh snapshot for backups this often
    min_step_s: float = 0.0  # pace: every step takes at least this long (a slower model, emulated for tests/benches)
    aq_buffer_dir: str | None = None  # AQ-SGD disk buffers (manifest buffer = "disk"); None: the temp directory
    checkpoint_dir: str | None = None  # where this node writes its slot's checkpoints (None: it writes none)
    resume_dir: str | None = None  # a stopped run's checkpoints to go on from (node/run/checkpoints.py)
    blob_dir: str | None = None  # files the run names by hash (weights, tokenizer); None: a folder in the temp directory
    blob_pull_attempt_s: float = 600.0  # how long one peer may take to send one such file
    broker: BrokerConfig = field(default_factory=BrokerConfig)  # when this node hosts (or takes over) the broker
    replan: ReplanConfig = field(default_factory=ReplanConfig)  # ... and places the run by the network
    client: RunClientConfig = field(default_factory=RunClientConfig)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.manifest, self.run_id, self.select)) != 1:
            raise ValueError("give a manifest, a run id or a run to find (select)")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError("max_steps must be >= 0")
        if self.switch_lead_s < 0 or self.switch_lead_min_steps < 1:
            raise ValueError("switch lead must be >= 0 s and >= 1 step")
        if self.backup_refresh_s <= 0 or self.round_timeout_s <= 0:
            raise ValueError("--backup-refresh and --round-timeout must be positive")
        if min(self.state_pull_timeout_s, self.state_pull_attempt_s, self.final_check_s, self.leave_timeout_s) <= 0:
            raise ValueError("state pull, final check and leave timeouts must be positive")
        if self.min_step_s < 0:
            raise ValueError("--min-step-time must be >= 0")
        if self.snapshot_every_steps < 1:
            raise ValueError("snapshot_every_steps must be >= 1")
