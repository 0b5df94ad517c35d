"""norm kernels."""
