"""Model building blocks: linear (+LoRA), routed experts (+LoRA), attention, norm, rotary."""
