"""lora kernels."""
