"""Checkpoint files: round trip, keep last K, atomic writes, corrupt and truncated files detected and skipped."""

from __future__ import annotations

import logging

import pytest
import torch

from shoal.node.train.checkpoint import CheckpointError, list_checkpoints, load_latest, read_checkpoint, save_checkpoint


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((64,), float(step)), "meta": {"name": "x", "list": [1, 2.5, None]}}


def test_round_trip(tmp_path):
    path = save_checkpoint(tmp_path, 7, state(7))
    back = read_checkpoint(path)
    assert back["step"] == 7 and torch.equal(back["w"], state(7)["w"]) and back["meta"] == state(7)["meta"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_keeps_the_last_k(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step * 10, state(step), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    assert load_latest(tmp_path)[0] == 50


def test_empty_directory(tmp_path):
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[: len(raw) // 2], "truncated"),
        (lambda raw: raw[:20], "truncated"),
        (lambda raw: raw[:-100] + bytes(b ^ 0xFF for b in raw[-100:-99]) + raw[-99:], "checksum mismatch"),
        (lambda raw: b"NOTSHOAL" + raw[8:], "bad magic"),
    ],
)
def test_damaged_newest_is_detected_and_the_previous_one_used(tmp_path, caplog, damage, message):
    save_checkpoint(tmp_path, 1, state(1))
    newest = save_checkpoint(tmp_path, 2, state(2))
    newest.write_bytes(damage(newest.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="shoal.node.train.checkpoint"):
        step, loaded = load_latest(tmp_path)
    assert step == 1 and loaded["step"] == 1
    assert message in caplog.text


def test_all_damaged_means_none(tmp_path):
    p = save_checkpoint(tmp_path, 1, state(1))
    p.write_bytes(b"")
    assert load_latest(tmp_path) is None
