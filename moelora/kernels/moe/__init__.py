"""moe kernels."""
