"""Benchmarks: ``python -m jaxcomm.bench <name> [--help]``; each prints a table, writes JSON."""
