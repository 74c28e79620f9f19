"""Benchmarks of pocketflow side by side with Redis, S3 (SeaweedFS) and raw loopback TCP.

``python -m pytest benchmarks/ --benchmark-only`` runs the pytest-benchmark suite;
``python -m benchmarks.compare --quick|--full`` (or ``pocketflow bench``) runs the side-by-side
comparison and writes JSON, PNG plots and a Markdown summary under ``benchmarks/results/``.
This package is not installed with pocketflow: run it from a source checkout.
"""
