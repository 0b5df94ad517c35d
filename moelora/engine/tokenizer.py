"""Tokenizer wrapper, incremental (streaming) detokenization and stop-string handling."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Tokens of context decoded before the new ones, so that space/prefix handling
# (e.g. SentencePiece's leading "▁") matches a full decode. Same value as vLLM.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A model folder's tokenizer (tokenizer.json + tokenizer_config.json), loaded locally only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {self.path} (expected tokenizer.json and "
                             f"tokenizer_config.json there): {e}") from e
        # the tokenizer's EOS id, then those of generation_config.json
        self.eos_token_ids: list[int] = [] if self.hf.eos_token_id is None else [int(self.hf.eos_token_id)]
        gen_cfg = self.path / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            for i in [eos] if isinstance(eos, int) else (eos or []):
                if int(i) not in self.eos_token_ids:
                    self.eos_token_ids.append(int(i))
        # the Rust tokenizer behind a transformers TokenizersBackend: hf.decode's result without the clean-up, in ~1/3
        # of the time (no Python argument handling per call), which the streaming detokenizer pays twice a token
        rust = getattr(self.hf, "_tokenizer", None)
        self.backend: RustTokenizer | None = rust if isinstance(rust, RustTokenizer) else None

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (the tokenizer's own, else the first from generation_config.json)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render messages ([{"role": ..., "content": ...}]) with the tokenizer's chat template."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"the tokenizer at {self.path} has no chat template (no 'chat_template' in "
                             f"tokenizer_config.json nor chat_template.jinja); use the completions API with a plain "
                             "prompt")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas (vLLM / TGI's offsets technique).

    Each step decodes ids[prefix_offset:read_offset] and ids[prefix_offset:]; the difference is the
    new text. A delta is held back while the text ends in an incomplete UTF-8 character ('\\ufffd'),
    so a character split over several byte-level tokens is emitted once, whole. A replacement char
    that stays (truly invalid bytes) is emitted as soon as a later token follows it, or by flush()."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids or [])
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        # no clean-up: it rewrites spaces around punctuation differently for a window and the whole text
        if self.tokenizer.backend is not None:  # the same string as hf.decode below, without its Python wrapper
            return self.tokenizer.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.hf.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                        clean_up_tokenization_spaces=False)

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (often "", never a partial char)."""
        self.token_ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of generation: emit what is still held back (an invalid byte sequence as '\\ufffd')."""
        if self.read_offset == len(self.token_ids):
            return ""
        return self._delta(final=True)


class StopChecker:
    """Stop strings over a streamed text, with holdback of a possible stop-string prefix.

    update(delta) returns the text safe to emit now: never a stop string (unless
    include_stop_str_in_output) and never a tail that might still grow into one. When several stop
    strings occur, the one whose occurrence ends first wins (ties: the longer), so the result does not
    depend on how the text was split into deltas."""

    def __init__(self, stop: list[str] | None, include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # all text received
        self.emitted = 0  # length of text[:] already returned
        self.stopped = False
        self.stop_str: str | None = None
        self.output_text: str | None = None  # final (truncated) text once stopped

    @staticmethod
    def find_stop(text: str, stop: list[str], start: int = 0) -> tuple[int, int, str] | None:
        """Occurrence of a stop string in text[start:] that ends first: (begin, end, stop string) or None."""
        hits = [(i + len(s), i, s) for s in stop if (i := text.find(s, start)) >= 0]  # (end, begin, s)
        if not hits:
            return None
        end, begin, s = min(hits)  # the first to end; ties: the longer (it begins first)
        return begin, end, s

    def _holdback(self) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def update(self, delta: str) -> str:
        """Add newly decoded text; return what may be emitted now. Check .stopped afterwards."""
        if self.stopped:
            return ""
        if not self.stop:  # nothing to find or hold back: all of it may go (what the general path returns too)
            self.text += delta
            self.emitted = len(self.text)
            return delta
        max_len = max((len(s) for s in self.stop), default=0)
        # any match ends inside the new text: earlier text had none, or we would have stopped
        search_from = max(0, len(self.text) - max_len + 1)
        self.text += delta
        hit = self.find_stop(self.text, self.stop, search_from)
        if hit is not None:
            begin, end, s = hit
            self.stopped, self.stop_str = True, s
            self.output_text = self.text[: end if self.include_stop_str_in_output else begin]
            out = self.output_text[self.emitted :]
            self.emitted = len(self.output_text)
            return out
        safe = len(self.text) - self._holdback()
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        """Generation ended without a stop string: release the held-back tail."""
        if self.stopped:
            return ""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        self.output_text = self.text
        return out
