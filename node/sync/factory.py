"""`make_synchronizer`: the manifest's `plan.sync.method` as a synchronizer over the group collective."""

from __future__ import annotations

import time
from collections.abc import Callable

from shoal.kernels.cocktail import CocktailConfig
from shoal.node.sync.allreduce import AllReduceSync
from shoal.node.sync.base import Exchange, SyncConfig
from shoal.node.sync.cocktail import CocktailSync
from shoal.node.sync.diloco import DilocoSync
from shoal.node.sync.interface import NoSync, Synchronizer
from shoal.protocol.manifest import RunManifest
from shoal.swarm.net.penalty import Penalties


def make_synchronizer(manifest: RunManifest, *, exchange: Exchange, penalties: Penalties,
                      config: SyncConfig = SyncConfig(), clock: Callable[[], float] = time.monotonic) -> Synchronizer:
    """The synchronizer of `manifest.plan.sync.method`; NoSync for 'none'."""
    spec = manifest.plan.sync
    kw = dict(exchange=exchange, penalties=penalties, config=config, clock=clock)
    if spec.method == "none":
        return NoSync()
    if spec.method == "allreduce":
        return AllReduceSync(dtype=spec.allreduce.dtype, **kw)
    if spec.method == "cocktail":
        c = spec.cocktail
        return CocktailSync(cocktail=CocktailConfig(p=c.p, r=c.r, bits=c.bits), warmup_steps=c.warmup_steps,
                            warmup_bits=c.warmup_bits,
                            allreduce_dtype=spec.allreduce.dtype, **kw)
    if spec.method == "diloco":
        d = spec.diloco
        return DilocoSync(inner_steps=d.inner_steps, outer_lr=d.outer_lr, outer_momentum=d.outer_momentum,
                          fragments=d.fragments, e3m0=d.e3m0, overlap_steps=d.overlap_steps,
                          merge_alpha=d.merge_alpha, **kw)
    raise ValueError(f"unknown sync method {spec.method!r}")
