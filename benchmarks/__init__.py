"""Benchmarks of pocketflow side by side with Redis, S3 (SeaweedFS) and raw loopback TCP.

``python -m pytest benchmarks/ --benchmark-only`` runs the pytest-benchmark suite;
``python -m benchmarks.compare --quick|--full`` runs the side-by-side comparison and writes JSON,
PNG plots and a Markdown summary under ``benchmarks/results/``.
"""
