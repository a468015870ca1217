"""A node's part in a training run: the step loop on the event loop, its config, snapshots, votes and status."""
