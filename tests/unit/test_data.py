"""Data: the stdlib corpus, the held-out split, samples with stable ids, deterministic sharding and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shoal.node.train.data import Samples, ShardedSampler, heldout_batches, load_corpus


def test_stdlib_corpus_is_tens_of_megabytes_with_a_fixed_heldout_split():
    c = load_corpus("stdlib", 20)
    total = len(c.train) + len(c.heldout)
    assert total > 5_000_000
    assert 0.03 < len(c.heldout) / total < 0.07
    load_corpus.cache_clear()
    again = load_corpus("stdlib", 20)
    assert again.fingerprint == c.fingerprint
    assert np.array_equal(again.heldout, c.heldout)
    assert b"# file: " in c.train[:1000].tobytes()


def test_samples_are_windows_with_shifted_targets():
    s = Samples(np.arange(100, dtype=np.uint8), 10)
    assert s.num_samples == 9
    x, y = s.get(torch.tensor([0, 3]))
    assert x.dtype == torch.long and x.shape == (2, 10)
    assert x[1].tolist() == list(range(30, 40)) and y[1].tolist() == list(range(31, 41))


@pytest.mark.parametrize(("num_samples", "replicas"), [(37, 3), (64, 4), (10, 1), (5, 7)])
def test_sharding_is_disjoint_and_complete(num_samples, replicas):
    per_replica = []
    for r in range(replicas):
        sampler = ShardedSampler(num_samples, seed=11, replica=r, replicas=replicas)
        n = len(range(r, num_samples, replicas))  # this replica's share of one epoch
        per_replica.append(sampler.next_ids(n).tolist() if n else [])
    seen = [i for ids in per_replica for i in ids]
    assert sorted(seen) == list(range(num_samples))  # complete, and no id twice: disjoint


def test_sharding_spans_epochs_with_a_new_order():
    s = ShardedSampler(20, seed=1)
    first, second = s.next_ids(20).tolist(), s.next_ids(20).tolist()
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second and s.epoch() == 2


def test_sampler_resumes_at_the_right_sample():
    straight = ShardedSampler(50, seed=3, replica=1, replicas=2)
    expected = [straight.next_ids(8).tolist() for _ in range(6)]
    resumed = ShardedSampler(50, seed=3, replica=1, replicas=2)
    got = [resumed.next_ids(8).tolist() for _ in range(2)]
    restarted = ShardedSampler(50, seed=3, replica=1, replicas=2, position=resumed.position)
    got += [restarted.next_ids(8).tolist() for _ in range(4)]
    assert got == expected


def test_order_depends_on_seed():
    a = ShardedSampler(100, seed=1).next_ids(20)
    b = ShardedSampler(100, seed=2).next_ids(20)
    assert not torch.equal(a, b)


def test_heldout_batches_are_fixed():
    s = Samples(np.zeros(1000, dtype=np.uint8), 10)
    a, b = heldout_batches(s, 4, 3), heldout_batches(s, 4, 3)
    assert [t.tolist() for t in a] == [t.tolist() for t in b] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_local_txt_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 500)
    rows = [{"text": f"document {i}"} for i in range(300)]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    txt = load_corpus(str(tmp_path / "a.txt"), 10)
    assert len(txt.heldout) > 0 and b"hello world" in txt.train.tobytes()
    js = load_corpus(str(tmp_path / "b.jsonl"), 10)
    assert b"document 7\n" in (js.train.tobytes() + js.heldout.tobytes())
    both = load_corpus(str(tmp_path), 10)
    assert len(both.train) + len(both.heldout) > len(txt.train) + len(js.train)
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(str(tmp_path / "missing.txt"), 10)
    (tmp_path / "bad.jsonl").write_text('{"title": 1}\n')
    with pytest.raises(ValueError, match="text"):
        load_corpus(str(tmp_path / "bad.jsonl"), 10)
