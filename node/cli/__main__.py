"""`python -m shoal.node.cli` is the `shoal` command (how the local swarm starts its node processes)."""

from shoal.node.cli import entry

entry()
