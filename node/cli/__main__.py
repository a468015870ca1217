"""`python -m shoal.node.cli` is the `shoal` command (how the local swarm starts its node processes)."""

import sys

from shoal.node.cli import main

sys.exit(main())
