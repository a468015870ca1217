"""`make_synchronizer`: the manifest's `plan.sync.method` as a synchronizer over the group collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from shoal.kernels.cocktail import CocktailConfig
from shoal.node.sync.allreduce import AllReduceSync
from shoal.node.sync.base import SyncConfig
from shoal.node.sync.cocktail import CocktailSync
from shoal.node.sync.diloco import DilocoSync
from shoal.node.train.trainer import NoSync, Synchronizer
from shoal.protocol.manifest import RunManifest
from shoal.swarm.run.group import Group
from shoal.swarm.net.penalty import Penalties

if TYPE_CHECKING:  # the synchronizers need no libp2p at import: only a collective's exchange
    from shoal.swarm.run.collective import Collective


def make_synchronizer(
    manifest: RunManifest,
    *,
    collective: Collective,
    group_fn: Callable[[], Group],
    trio_token: trio.lowlevel.TrioToken,
    penalties: Penalties,
    config: SyncConfig = SyncConfig(),
    on_missing: Callable[[list[str]], None] | None = None,
    on_offender: Callable[[str, str], None] | None = None,
) -> Synchronizer:
    """The synchronizer of `manifest.plan.sync.method`; NoSync for 'none'."""
    spec = manifest.plan.sync
    kw = dict(collective=collective, group_fn=group_fn, trio_token=trio_token, penalties=penalties, config=config,
              on_missing=on_missing, on_offender=on_offender)
    if spec.method == "none":
        return NoSync()
    if spec.method == "allreduce":
        return AllReduceSync(dtype=spec.allreduce.dtype, **kw)
    if spec.method == "cocktail":
        c = spec.cocktail
        return CocktailSync(cocktail=CocktailConfig(p=c.p, r=c.r, bits=c.bits), warmup_steps=c.warmup_steps,
                            allreduce_dtype=spec.allreduce.dtype, **kw)
    if spec.method == "diloco":
        d = spec.diloco
        return DilocoSync(inner_steps=d.inner_steps, outer_lr=d.outer_lr, outer_momentum=d.outer_momentum,
                          fragments=d.fragments, e3m0=d.e3m0, overlap_steps=d.overlap_steps,
                          merge_alpha=d.merge_alpha, **kw)
    raise ValueError(f"unknown sync method {spec.method!r}")
