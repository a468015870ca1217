"""One chunk owner cannot corrupt its chunk for everyone: every member checks each owner's broadcast against its own
contribution to that chunk, and an owner whose broadcasts keep opposing them is reported by the members and
evicted, while the honest replicas stay identical and learn."""

from __future__ import annotations

import pytest

from tests.adversarial.poisoner import (attack_manifest, broadcast, heldout_drop, honest_agree, poisoner,
                                       run_group)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("method", ["allreduce", "cocktail"])
async def test_an_owner_flipping_its_chunk_is_reported_by_every_member_and_evicted(method):
    steps = 14
    fault = poisoner(-1.0, phases=broadcast)  # its chunk's aggregate, sign-flipped, to every member
    manifest = attack_manifest(method, steps)
    reps, ids = await run_group(manifest, steps, timeout_s=3.0, faults={0: fault}, evict=True)
    bad, honest = ids[0], reps[1:]
    assert fault.sent >= 2 * 5  # it lied to both members, round after round, until it was evicted
    for r in honest:
        assert set(r.offenders) == {bad}, r.offenders
        assert not r.missing
    honest_agree(honest, steps)  # every member applied the same chunks, the forged one included, until eviction
    assert min(heldout_drop(honest, manifest)) > 0.5
