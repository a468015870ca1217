"""`shoal health`: exit 0 when a node's --status-file says it is up and sees peers (a container health check)."""

from __future__ import annotations

import argparse

HELP = "check a running node through its --status-file (exit 0: healthy), for container health checks"
DESCRIPTION = """\
Read the status file a node rewrites every few seconds (`shoal node --status-file F`)
and exit 0 when the node is healthy: the file is fresh, the node is past starting
(and not leaving or stopped by an error), and it sees at least --min-peers peers.
Otherwise print why and exit 1. It never touches the network, so it costs a few
milliseconds; the compose image runs it as its HEALTHCHECK.

  shoal health --status-file /data/status.json
  shoal health --status-file /data/status.json --min-peers 0    # up is enough (a bootstrap alone)
"""
UNHEALTHY_STATES = frozenset({"starting", "leaving"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--status-file", required=True, metavar="PATH", help="the node's --status-file")
    p.add_argument("--min-peers", type=int, default=1, help="peers it must see (default: 1)")
    p.add_argument("--max-age", type=float, default=30.0, metavar="SECONDS",
                   help="the file must have been written within this long (default: 30)")


def verdict(doc: dict, *, now: float, min_peers: int, max_age_s: float) -> str | None:
    """None when the status document says healthy, else the reason it does not."""
    age = now - float(doc.get("time", 0.0))
    if age > max_age_s:
        return f"status is {age:.0f} s old (the node is stuck or gone)"
    state = doc.get("state")
    if state in UNHEALTHY_STATES:
        return f"node is {state}"
    if doc.get("error"):
        return f"node reports an error: {doc['error']}"
    peers = len(doc.get("peers") or [])
    if peers < min_peers:
        return f"node sees {peers} peer(s), needs {min_peers}"
    return None


def main(args: argparse.Namespace) -> int:
    import json
    import sys
    import time

    try:
        with open(args.status_file, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        print(f"unhealthy: cannot read {args.status_file}: {e}", file=sys.stderr)
        return 1
    why = verdict(doc, now=time.time(), min_peers=args.min_peers, max_age_s=args.max_age)
    if why is not None:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    print(f"healthy: {doc.get('peer_id', '?')} {doc.get('role', '')} {doc.get('state', '')}, "
          f"{len(doc.get('peers') or [])} peers, step {doc.get('step', 0)}")
    return 0
