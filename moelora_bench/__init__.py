"""Benchmarks: `moelora bench kernels` (LoRA kernels against their byte floor)."""
