"""A snapshot a replica loads stays the state its hash names: it is kept and served by that hash afterwards (a
rollback's revision, a resumed slot's checkpoint), while the loaded trainer steps on."""

from __future__ import annotations

import pytest
import torch

from shoal.node.run.config import RunConfig
from shoal.node.run.replica import Replica
from shoal.node.train.trainer import Trainer
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state.snapshot import Snapshot, state_hash
from tests.unit.test_trainer import small_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("enter", [False, True])
async def test_a_loaded_snapshot_is_not_changed_by_the_steps_after_it(enter):
    """torch's optimizers keep the state tensors they are given (load_state_dict), and a synchronizer its own:
    loaded by reference, the next steps would rewrite the snapshot in place and the node would serve other bytes
    under the snapshot's hash, to be rejected and penalized by every honest puller."""
    m = small_run()
    source = Trainer(m)
    for _ in range(3):
        source.step()
    snap = Snapshot.of(source.state_dict(), 3)
    r = Replica(RunConfig(manifest=m), Penalties())
    r.trainer = Trainer(m)
    r.sync = r.trainer.sync
    await r.load(snap, enter=enter)
    assert r.at_step == 3
    for _ in range(2):
        r.trainer.step()
    assert state_hash(snap.tensors, snap.skeleton) == snap.hash
    # the trainer did step on, its optimizer's moments too: the check above could fail
    moved = Snapshot.of(r.trainer.state_dict(), 5)
    moments = [k for k in snap.tensors if k.startswith("/optimizer/state/") and k.endswith("/exp_avg")]
    assert moments and not any(torch.equal(moved.tensors[k], snap.tensors[k]) for k in moments)
