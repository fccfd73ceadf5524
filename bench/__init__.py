"""Benchmarks; each prints figures and ratios measured in one run."""
