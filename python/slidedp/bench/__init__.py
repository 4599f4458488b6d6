"""Benchmarks that print a figure and its ratio to a baseline measured in the same run."""
