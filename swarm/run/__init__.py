"""A run across the swarm: broker, run client, groups and their schedule, the group collective."""
