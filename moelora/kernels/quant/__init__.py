"""quant kernels."""
