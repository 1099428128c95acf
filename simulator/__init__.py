"""Capacity simulation: a workload replayed through the real scheduler, cache and routing code, with step
times measured on the GPU."""
