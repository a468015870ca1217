"""`shoal doctor`: the checks of this machine and of a swarm it would join."""
