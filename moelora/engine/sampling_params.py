"""Per-request sampling settings, with vLLM's field names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to turn one request's logits into tokens, and when to stop.

    temperature 0 means greedy (argmax). top_k 0 or -1 means no top-k filter.
    max_tokens None means "until EOS, a stop condition or the context limit".
    logprobs: how many top logprobs to return per generated token (the chosen
    token's own logprob is always returned). prompt_logprobs: the same for
    prompt positions. stop is normalized to a list of strings.
    logit_bias: token id -> a value in [-100, 100] added to that token's logit
    before penalties and sampling (OpenAI's logit_bias; logprobs see it too)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"SamplingParams: {msg}")

        for key in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(f"{key} must be a finite number, got {value!r}")
        if self.n < 1:
            fail(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        for key in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, key)) is not None and value < 0:
                fail(f"{key} must be >= 0 or None, got {value}")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for key in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= (value := getattr(self, key)) <= 2.0:
                fail(f"{key} must be in [-2, 2], got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        for t, b in (self.logit_bias or {}).items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                fail(f"logit_bias keys must be token ids (non-negative ints), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                fail(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
