"""Training on one node: model, data, the trainer and its step object, checkpoints, hardware (no network)."""
