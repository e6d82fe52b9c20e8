"""Benchmarks, each beside its baseline in the same run (`python launch.py bench`), writing JSON
and plots; and `stress`, random graphs against the NumPy reference (`python launch.py stress`).
"""
