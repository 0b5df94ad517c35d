"""moelora: one Mixture-of-Experts LLM, many LoRA adapters, one batch."""

__version__ = "0.1.0"

from moelora.engine.llm import LLM  # noqa: E402
from moelora.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from moelora.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
