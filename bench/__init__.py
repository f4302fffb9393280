"""Trellis benchmarks. `python -m bench [NAME ...]` runs them; results go to bench/results/."""
