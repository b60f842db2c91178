"""Evaluation: decode-speed benchmarks and benchmark x strategy runs."""
