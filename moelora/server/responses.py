"""The OpenAI response shapes of log-probabilities (completions and chat), from the engine's per-token dicts."""

from __future__ import annotations

from collections.abc import Callable

from moelora.server.async_engine import Update


class CompletionLogprobs:
    """The `logprobs` object of one completion choice, built across updates so that text_offset keeps counting
    (in streams too): tokens, token_logprobs, top_logprobs and text_offset, each one entry per token."""

    def __init__(self, token_str: Callable[[int], str], offset: int = 0) -> None:
        self.token_str, self.offset = token_str, offset

    def prompt(self, prompt_ids: list[int], prompt_logprobs: list | None) -> dict:
        """The echoed prompt's entries: the first token has no log-probability (nothing predicts it)."""
        out = self._empty()
        for i, tid in enumerate(prompt_ids):
            d = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) else None
            self._add(out, tid, d)
        return out

    def tokens(self, updates: list[Update]) -> dict:
        out = self._empty()
        for u in updates:
            for tid, d in zip(u.token_ids, u.logprobs):
                self._add(out, tid, d)
        return out

    @staticmethod
    def join(*parts: dict) -> dict:
        return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    @staticmethod
    def _empty() -> dict:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _add(self, out: dict, tid: int, d: dict[int, float] | None) -> None:
        s = self.token_str(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(None if d is None else d.get(tid))
        out["top_logprobs"].append(None if d is None else {self.token_str(t): lp for t, lp in d.items()})
        out["text_offset"].append(self.offset)
        self.offset += len(s)


def chat_logprobs(updates: list[Update], k: int, token_str: Callable[[int], str]) -> dict:
    content = []
    for u in updates:
        for tid, d in zip(u.token_ids, u.logprobs):
            s = token_str(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": s, "logprob": d.get(tid), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_str(t), "logprob": lp, "bytes": list(token_str(t).encode())}
                                             for t, lp in top]})
    return {"content": content}


def prompt_logprobs_field(prompt_ids: list[int], prompt_logprobs: list | None,
                          token_str: Callable[[int], str]) -> list | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt position None (the first) or
    {token id: {"logprob", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": lp, "decoded_token": token_str(t)} for t, lp in d.items()}
            for d in prompt_logprobs[: len(prompt_ids)]]
