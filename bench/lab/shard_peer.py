"""One peer of the shard-recovery benchmark, run inside a network namespace (`python -m shoal.bench.shard_peer`):
a holder serves shard `index` of a deterministic state (and the whole state, as a replica would); the puller
rebuilds the state from k shards in parallel and pulls it whole from one holder, alternately, and writes the times.

Every peer builds the same state, blob, shards and signed manifest from the seed, so nothing but the measured
transfers crosses the links.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.envelope import seal
from shoal.protocol.shards import ShardManifest
from shoal.swarm.net.host import HostConfig, open_host
from shoal.swarm.net.identity import peer_id_of
from shoal.swarm.net.penalty import Penalties
from shoal.swarm.state import erasure
from shoal.swarm.state.blob import snapshot_bytes
from shoal.swarm.state.shards import HeldShard, ShardConfig, ShardService, ShardStore, rebuild, sha256_hex
from shoal.swarm.state.snapshot import Snapshot
from shoal.swarm.state.transfer import StateServer, StateTransferConfig, pull_state

log = logging.getLogger("shard_peer")


def key(seed: int, who: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{seed}/{who}".encode()).digest())


def state(seed: int, mb: float) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    n = int(mb * 1e6 / 4)
    tensors = {"model": {f"w{i}": torch.randn(n // 8, generator=g) for i in range(8)}, "step": 100, "stage": 0}
    return Snapshot.of(tensors, 100, copy=False)


def shards_of(seed: int, mb: float, k: int, m: int, holders: list[str]) -> tuple[Snapshot, ShardManifest, bytes, list]:
    snap = state(seed, mb)
    blob = snapshot_bytes(snap)
    shards = erasure.encode(blob, k, m)
    enc = key(seed, "encoder")
    man = ShardManifest(peer_id=peer_id_of(enc), run_id="b" * 64, stage=0, revision=100, state_hash=snap.hash,
                        state_bytes=len(blob), k=k, m=m, shard_bytes=len(shards[0]),
                        shard_hashes=tuple(sha256_hex(s) for s in shards), holders=tuple(holders), time=1.7e9)
    return snap, man, seal(man, enc), shards


async def holder(args) -> None:
    holders = [peer_id_of(key(args.seed, f"holder{i}")) for i in range(args.k + args.m)]
    snap, man, raw, shards = shards_of(args.seed, args.state_mb, args.k, args.m, holders)
    async with open_host(key(args.seed, f"holder{args.index}"), HostConfig(listen=f"/ip4/{args.ip}/tcp/0")) as sh:
        store = ShardStore()
        store.put(HeldShard(manifest=man, raw=raw, index=args.index, data=bytes(shards[args.index])))
        store.commit(0, 100)
        ShardService(sh, man.run_id, store, member=lambda p: True, encoder_of=lambda *a: True,
                     penalties=Penalties(), config=ShardConfig(per_peer=1000))
        StateServer(sh, lambda: snap, config=StateTransferConfig(timeout_s=600))
        Path(args.out, f"holder{args.index}.addr").write_text(sh.addrs[0] + "\n")
        log.info("holder %d: shard of %d bytes, state %d bytes", args.index, len(shards[args.index]), len(raw))
        await trio.sleep_forever()


async def puller(args) -> None:
    n = args.k + args.m
    holders = [peer_id_of(key(args.seed, f"holder{i}")) for i in range(n)]
    snap, man, _, _ = shards_of(args.seed, args.state_mb, args.k, args.m, holders)
    del snap
    files = [Path(args.out, f"holder{i}.addr") for i in range(n)]
    while not all(f.exists() for f in files):
        await trio.sleep(0.2)
    trials = []
    async with open_host(key(args.seed, "puller"), HostConfig(listen=f"/ip4/{args.ip}/tcp/0")) as sh:
        for f in files:
            await sh.connect(f.read_text().strip())
        cfg = ShardConfig(timeout_s=600)
        for t in range(args.trials):
            t0 = time.monotonic()
            got = await rebuild(sh, man, set(holders[args.skip:]), penalties=Penalties(), config=cfg)
            ec_s = time.monotonic() - t0
            assert got.snapshot.hash == man.state_hash
            t0 = time.monotonic()
            whole = await pull_state(sh, holders[-1], config=StateTransferConfig(timeout_s=600))
            full_s = time.monotonic() - t0
            assert whole.hash == man.state_hash
            trials.append({"trial": t, "shards_s": round(ec_s, 3), "full_s": round(full_s, 3),
                           "ratio": round(ec_s / full_s, 3), "shard_bytes": man.shard_bytes,
                           "state_bytes": man.state_bytes, "bytes_pulled": got.bytes_pulled})
            log.info("trial %d: %s", t, trials[-1])
    Path(args.out, "puller.json").write_text(json.dumps(trials, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("holder", "puller"))
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--ip", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--state-mb", type=float, default=20.0)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--skip", type=int, default=0, help="the puller skips the first SKIP holders (lost with the stage)")
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    trio.run(holder if args.role == "holder" else puller, args)


if __name__ == "__main__":
    main()
