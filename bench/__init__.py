"""Benchmarks, the demo and the `kvoffload` command line; they use public APIs only."""
