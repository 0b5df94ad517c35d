"""attention kernels."""
