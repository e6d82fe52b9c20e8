"""The CUDA backend's kernels of our own: CUDA C compiled at start-up, each with a NumPy twin
(device.py says how to add one; MODULES lists these modules)."""
