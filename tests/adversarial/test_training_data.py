"""A run's manifest cannot point a volunteer's node at the volunteer's own files: a run joined by id may name the
built-in corpus or a dataset by name; a local path is read only from the volunteer's own `--data`."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.run.config import RunConfig
from shoal.node.run.preflight import UntrustedData, data_source
from shoal.protocol import manifest as mf
from tests.helpers.progress import wait_training
from tests.helpers.swarm import running_node
from tests.swarm.test_run_runtime import node_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def path_manifest(owner: Ed25519PrivateKey, source: str) -> mf.RunManifest:
    return mf.RunManifest(
        seed=3, model=mf.ModelSpec(size="custom", n_layers=1, d_model=32, n_heads=4),
        batch=mf.BatchSpec(batch_size=4, micro_batch_size=4, seq_len=32), data=mf.DataSpec(source=source),
        optim=mf.OptimSpec(lr=3e-3, warmup_steps=2, total_steps=1000), eval=mf.EvalSpec(every_steps=0, batches=2),
        plan=mf.ParallelPlan(replicas=2, sync=mf.SyncSpec(method="allreduce"))).signed(owner)


@asynccontextmanager
async def owner_node(key: Ed25519PrivateKey, config):
    """The run's owner, with the identity that signed its manifest."""
    async with running_node(list(config.host.join), config, key=key) as node:
        yield node


def by_id(config, run_id: str, data: str | None = None):
    """A volunteer joining the run by its id: the manifest comes from the swarm."""
    return replace(config, run=replace(config.run, manifest=None, run_id=run_id, data=data))


async def test_a_run_naming_a_local_path_cannot_make_a_joiner_read_it(tmp_path):
    private = tmp_path / "volunteer_notes.txt"  # on the volunteer's machine (the owner's too: one machine here)
    private.write_text("the volunteer's private notes, never to be trained on\n" * 4000)
    own_copy = tmp_path / "corpus.txt"
    own_copy.write_text("a corpus the volunteer chose to train this run on\n" * 4000)
    owner = Ed25519PrivateKey.generate()
    m = path_manifest(owner, str(private))
    cfg = node_config(m, 6, start_wait_s=30.0)
    async with owner_node(owner, cfg) as first:
        with pytest.RaisesGroup(pytest.RaisesExc(UntrustedData, match="--data PATH"), flatten_subgroups=True):
            async with running_node(first.sh.addrs, by_id(cfg, m.run_id)):
                pass
        async with running_node(first.sh.addrs, by_id(cfg, m.run_id, data=str(own_copy))) as volunteer:
            await wait_training([volunteer], 1, 3, 60, "the volunteer to train on its own --data")
            assert volunteer.runtime.data_source == str(own_copy)


@pytest.mark.parametrize("source", ["hf:/etc", "hf:../../home", "hf:~/secrets", "hf:./data", "/etc/hostname"])
def test_a_network_manifest_names_datasets_only_by_name(source):
    m = path_manifest(Ed25519PrivateKey.generate(), source)
    with pytest.raises(UntrustedData):
        data_source(m, RunConfig(run_id=m.run_id))
    assert data_source(m, RunConfig(manifest=m)) == source  # the volunteer's own manifest file: its own choice
    named = path_manifest(Ed25519PrivateKey.generate(), "hf:roneneldan/TinyStories")
    assert data_source(named, RunConfig(run_id=named.run_id)) == "hf:roneneldan/TinyStories"


def test_a_trainer_never_opens_a_path_a_manifest_names_by_itself(tmp_path, monkeypatch):
    """Whoever builds a Trainer from a manifest alone (a library user, a test, a tool) gets the built-in corpus or
    a named dataset, never the file the manifest's owner chose; a caller that trusts the path loads it itself."""
    import builtins
    import pathlib

    from shoal.node.train.data import load_corpus
    from shoal.node.train.trainer import Trainer

    private = tmp_path / "volunteer_notes.txt"
    private.write_text("the volunteer's private notes, never to be trained on\n" * 4000)
    opened: list[str] = []
    real_open, real_read = builtins.open, pathlib.Path.read_bytes
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda p: (opened.append(str(p)), real_read(p))[1])
    m = path_manifest(Ed25519PrivateKey.generate(), str(private))
    with pytest.raises(ValueError, match="never opens a path a manifest names"):
        Trainer(m)
    assert str(private) not in opened
    t = Trainer(m, corpus=load_corpus(str(private), m.data.heldout_every))  # the caller's own decision
    assert str(private) in opened and t.corpus.description.startswith(str(private))
