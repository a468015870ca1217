"""Shoal's convergence and codec experiments (`shoal bench ...`): measurements, kept out of the runtime."""
