"""A replica's state between nodes: snapshots and hashes, transfer, and the rule for which hash replicas follow."""
