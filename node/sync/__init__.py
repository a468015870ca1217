"""What keeps the replicas of a stage together: the synchronizer contract and its implementations."""
