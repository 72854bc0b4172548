"""Benchmarks: ``python -m experiments.bench <name> [--help]``; each prints a table, writes JSON."""
