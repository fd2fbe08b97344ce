"""Numerical kernels. Each efficient op has a naive twin in `ops/naive.py`."""
