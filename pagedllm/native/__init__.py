"""Native CPU kernels built on first use with the system C compiler (see kernels.py)."""
