"""PEFT adapters: loading and validation, the CPU registry, GPU slots, per-batch LoRA metadata."""
