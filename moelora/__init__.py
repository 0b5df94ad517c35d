"""moelora: one Mixture-of-Experts LLM, many LoRA adapters, one batch."""

__version__ = "0.1.0"
