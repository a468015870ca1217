"""A replica's state between nodes: snapshots and hashes, transfer, and the majority rule."""
