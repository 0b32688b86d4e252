"""Benchmarks: kernel speed and memory (kernels.py), training stability across settings (stability.py)."""
