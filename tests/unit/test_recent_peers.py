"""The recent-peers file beside the identity: written atomically, read strictly, never a reason not to start."""

from __future__ import annotations

import json
import stat

from shoal.swarm.net.recent_peers import (MAX_PEERS, load_recent_peers, recent_peers_path,
                                          save_recent_peers)

A = "12D3KooWQSYffg49u2uqHZY3Xs855MMrf7HVhaNpxyLTwjP8D8rw"
B = "12D3KooWFuKhfcaUvKVcXpK7ZMHy2wYJkgdNdtcdTCSMvvz4Ms4Z"


def addr(port: int, pid: str) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{pid}"


def test_peers_round_trip_beside_the_identity_in_order_and_private(tmp_path):
    path = recent_peers_path(tmp_path / "node0.key")
    assert path == tmp_path / "node0.peers.json"
    peers = {B: [addr(4002, B)], A: [addr(4001, A), addr(4003, A)]}
    save_recent_peers(path, peers)
    assert load_recent_peers(path) == peers and list(load_recent_peers(path)) == [B, A]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["node0.peers.json"]  # no temp file left behind


def test_a_missing_corrupt_or_hostile_file_reads_as_what_is_usable(tmp_path):
    path = tmp_path / "x.peers.json"
    assert load_recent_peers(path) == {}
    path.write_text("{not json")
    assert load_recent_peers(path) == {}
    path.write_text(json.dumps({"peers": [
        {"peer_id": A, "addrs": [addr(1, A), addr(2, B), "not an address/p2p/" + A, 7] + [addr(9, A)] * 9},
        {"peer_id": B, "addrs": "nope"}, "junk"]}))
    assert load_recent_peers(path) == {A: [addr(1, A)]}  # its own, well-formed addresses; the first few looked at
    path.write_text(json.dumps({"peers": ["junk"] * MAX_PEERS + [{"peer_id": A, "addrs": [addr(1, A)]}]}))
    assert load_recent_peers(path) == {}  # only the first MAX_PEERS rows are read
    path.write_bytes(b" " * (70 * 1024))
    assert load_recent_peers(path) == {}
