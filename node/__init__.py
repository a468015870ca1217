"""shoal.node: the daemon, the command line and the training runtime."""
