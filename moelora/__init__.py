"""moelora: one Mixture-of-Experts LLM, many LoRA adapters, one batch."""

__version__ = "0.1.0"

import faulthandler as _faulthandler  # noqa: E402
import os as _os  # noqa: E402

if _os.environ.get("MOELORA_DUMP_STACKS_S"):  # debugging a stuck run: every process prints every thread's stack
    _faulthandler.dump_traceback_later(float(_os.environ["MOELORA_DUMP_STACKS_S"]), repeat=True)

from moelora.engine.llm import LLM  # noqa: E402
from moelora.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from moelora.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
