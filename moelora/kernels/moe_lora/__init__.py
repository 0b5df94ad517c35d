"""moe_lora kernels."""
