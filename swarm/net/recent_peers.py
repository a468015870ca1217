"""Peers this node saw recently, kept in a small file next to its identity: a node that restarts (a crash, a reboot,
a new port) dials them again and finds its swarm without a --join."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import multiaddr

log = logging.getLogger(__name__)

MAX_PEERS = 16  # the most recently seen peers kept
MAX_ADDRS = 4  # addresses kept per peer
MAX_FILE_BYTES = 64 * 1024


def recent_peers_path(identity: Path) -> Path:
    """The file beside an identity key: `node0.key` -> `node0.peers.json`."""
    identity = Path(identity).expanduser()
    return identity.with_name(f"{identity.stem}.peers.json")


def _dialable(addr: object, peer_id: str) -> bool:
    if not isinstance(addr, str) or len(addr) > 300 or not addr.endswith(f"/p2p/{peer_id}"):
        return False
    try:
        multiaddr.Multiaddr(addr)
    except Exception:  # noqa: BLE001 - a malformed entry is skipped
        return False
    return True


def load_recent_peers(path: Path) -> dict[str, list[str]]:
    """peer id -> its full multiaddrs (…/p2p/<id>), most recently seen first. A missing, oversized or corrupt file
    reads as empty (it is a hint, never a reason not to start); malformed entries are skipped."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        doc = json.loads(path.read_text())
        peers = doc["peers"]
        if not isinstance(peers, list):
            raise ValueError("'peers' is not a list")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.info("recent peers file %s ignored: %s", path, e)
        return {}
    out: dict[str, list[str]] = {}
    for row in peers[:MAX_PEERS]:
        if isinstance(row, dict) and isinstance(row.get("peer_id"), str) and isinstance(row.get("addrs"), list):
            pid = row["peer_id"]
            addrs = [a for a in row["addrs"][:MAX_ADDRS] if _dialable(a, pid)]
            if addrs:
                out[pid] = addrs
    return out


def save_recent_peers(path: Path, peers: dict[str, list[str]]) -> None:
    """Write atomically (a temp file, fsync, rename; mode 0600): a crash leaves the old file or the new one."""
    rows = [{"peer_id": pid, "addrs": list(addrs)[:MAX_ADDRS]} for pid, addrs in list(peers.items())[:MAX_PEERS]]
    data = json.dumps({"peers": rows}, indent=1).encode()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
