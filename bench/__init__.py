"""Benchmarks: stepstream against its reference (pydantic-ai-harness) and the machine's limits.

Run with `make bench` (or `python -m bench`); see docs/benchmarks.md for what each workload
measures and the recorded numbers. This package must stay importable without stepstream
installed: `bench.workload`, `bench.harness_run` and `bench.plot` also run in the separate
virtual environment that holds the reference library (which pins another pydantic-ai).
"""
