"""Request bodies of the OpenAI API (and vLLM's extensions), their checks, and their mapping to SamplingParams.

Every field a request may send is declared here; a field moelora does not implement is refused with a 400 that
names it and says why (unsupported_fields), never accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moelora.engine.sampling_params import SamplingParams

# Sampling fields a request may leave out, with the value used when neither it nor the model's
# generation_config.json gives one (vLLM's defaults).
SAMPLING_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                              "repetition_penalty": 1.0}

# Fields of the OpenAI API (or vLLM's) that moelora does not implement, and why. Anything else a request
# sends that is not declared on its model is refused as unknown.
NOT_IMPLEMENTED: dict[str, str] = {
    **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls"), "tool calls are not supported yet"),
    **dict.fromkeys(("functions", "function_call"), "function calls are not supported"),
    "response_format": "structured output (response_format other than {\"type\": \"text\"}) is not supported yet",
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
                    "structured output is not supported yet"),
    "suffix": "insertion after a suffix is not supported",
    "best_of": "best_of is not supported (it would sample best_of completions and return the n best): use n",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning controls are not supported",
    "web_search_options": "web search is not supported",
    "min_tokens": "min_tokens is not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported: send a prompt that fits",
}


def unsupported_fields(body: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` that moelora would otherwise ignore, or None.
    Declared fields whose value means "off" (tools: [], response_format: {"type": "text"}, ...) pass."""
    for key, value in (body.model_extra or {}).items():
        if key in NOT_IMPLEMENTED:
            if _is_off(key, value):
                continue
            return key, f"{key!r} is not supported by moelora: {NOT_IMPLEMENTED[key]}"
        return key, f"unknown field {key!r}: moelora does not implement it (see the OpenAI completions/chat API)"
    return None


_OFF_VALUES: dict[str, Any] = {"tool_choice": "none", "best_of": 1, "modalities": ["text"]}


def _is_off(key: str, value: Any) -> bool:
    # parallel_tool_calls is meaningless without tools, which are refused on their own
    if value is None or value == [] or value == "" or key == "parallel_tool_calls":
        return True
    if key == "response_format":
        return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1
    return key in _OFF_VALUES and value == _OFF_VALUES[key]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    # unknown fields are kept in model_extra and refused by unsupported_fields(); NaN and infinities are refused
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    n: int = 1
    temperature: float | None = None  # None: generation_config.json's, else 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None  # OpenAI: an end-user id for the caller's own tracking; moelora logs nothing of it

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, float | int]) -> SamplingParams:
        """SamplingParams for this request; a sampling field left out takes defaults[field] (the model's
        generation_config.json), else SAMPLING_DEFAULTS[field]. Raises ValueError for bad values."""
        def pick(key: str):
            value = getattr(self, key)
            return value if value is not None else defaults.get(key, SAMPLING_DEFAULTS[key])

        bias = None
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        return SamplingParams(n=1, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
                              min_p=pick("min_p"), seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, repetition_penalty=pick("repetition_penalty"),
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              skip_special_tokens=self.skip_special_tokens, logit_bias=bias,
                              include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """stream_options.continuous_usage_stats (vLLM's): the usage so far in every chunk of the stream."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0: no generated token (with echo: the prompt alone, for scoring)
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM extension

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # one prompt of token ids
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: carried by the chat template or not
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""

    def non_text_part(self) -> str | None:
        """The type of the first content part that is not text (images, audio): refused, not dropped."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text":
                    return str(part.get("type"))
        return None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: generation_config.json's max_new_tokens, else up to the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
