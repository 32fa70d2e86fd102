"""Benchmarks: runnable scripts (`python -m bench.NAME`) that print a table and write bench/results/NAME.md."""
