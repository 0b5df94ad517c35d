"""Tokenizer wrapper, streaming detokenization (multi-byte UTF-8) and stop strings; CPU, no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from moelora.engine.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello world, hello there", "héllo 日本語 🙂", "the quick brown fox jumps"] * 5
TEXTS = [
    "héllo 日本語 🙂",
    "a🙂🙂b  日本 x",
    "the quick brown fox héllo wörld ß€𝄞",
    " leading space and trailing ",
]


def _build(folder: Path, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer; vocab_size 256 + specials gives pure bytes (every multi-byte char split)."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module", params=["merged", "bytes_only"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    vocab = 400 if request.param == "merged" else 256 + len(SPECIALS)
    return Tokenizer(_build(tmp_path_factory.mktemp(request.param), vocab))


def test_encode_decode_roundtrip(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bytes_only_splits_multibyte_chars(tmp_path: Path) -> None:
    tok = Tokenizer(_build(tmp_path, 256 + len(SPECIALS)))
    ids = tok.encode("🙂")
    assert len(ids) == 4  # one token per UTF-8 byte: the detokenizer tests below really see split chars
    assert all(tok.decode([i]) == "\ufffd" for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_streams_multibyte(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_token(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text


def test_incremental_detokenizer_with_prompt_context(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("hello 日本")
    gen = tokenizer.encode(" 語 🙂 world")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    out = "".join(detok.add_token(i) for i in gen) + detok.flush()
    assert out == tokenizer.decode(prompt + gen)[len(tokenizer.decode(prompt)) :] == " 語 🙂 world"


def test_incremental_detokenizer_skips_special_tokens(tokenizer: Tokenizer) -> None:
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("日本") + [end] + tokenizer.encode("x")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(detok.add_token(i) for i in ids) + detok.flush() == "日本x"
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(detok.add_token(i) for i in ids) + detok.flush() == "日本<|im_end|>x"


def test_incremental_detokenizer_invalid_bytes_emitted_once_complete(tmp_path: Path) -> None:
    tok = Tokenizer(_build(tmp_path, 256 + len(SPECIALS)))
    emoji = tok.encode("🙂")  # 4 byte tokens
    detok = IncrementalDetokenizer(tok)
    # first 2 bytes of the emoji, then "a": the broken char can never complete
    deltas = [detok.add_token(i) for i in emoji[:2]]
    assert deltas == ["", ""]
    after = detok.add_token(tok.encode("a")[0])
    assert after.endswith("a") and "\ufffd" in after
    # a truncated tail is released only by flush()
    detok2 = IncrementalDetokenizer(tok)
    assert [detok2.add_token(i) for i in emoji[:3]] == ["", "", ""]
    assert detok2.flush() == "\ufffd"


def test_incremental_detokenizer_backend_path_equals_the_transformers_decode(tokenizer: Tokenizer) -> None:
    """The streaming detokenizer decodes with the Rust tokenizer directly (no transformers wrapper per call): the
    same deltas as through hf.decode, for random ids (invalid byte runs and special tokens included), with and
    without prompt context and special tokens skipped or kept."""
    import random

    assert tokenizer.backend is not None  # a fast tokenizer: the direct path is taken
    rng = random.Random(7)
    vocab = len(tokenizer.hf)
    plain = Tokenizer.__new__(Tokenizer)
    plain.__dict__.update(tokenizer.__dict__, backend=None)  # the same tokenizer through hf.decode
    for trial in range(6):
        ids = [rng.randrange(vocab) for _ in range(40)]
        prompt = [rng.randrange(vocab) for _ in range(trial)]
        skip = trial % 2 == 0
        fast = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special_tokens=skip)
        slow = IncrementalDetokenizer(plain, prompt_ids=prompt, skip_special_tokens=skip)
        got = [fast.add_token(i) for i in ids] + [fast.flush()]
        want = [slow.add_token(i) for i in ids] + [slow.flush()]
        assert got == want
        assert "".join(got) != "" and fast.text == slow.text


def test_eos_ids_include_generation_config(tmp_path: Path) -> None:
    folder = _build(tmp_path, 300)
    tok = Tokenizer(folder)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    eot = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == im_end and tok.eos_token_ids == [im_end]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    tok = Tokenizer(folder)
    assert tok.eos_token_id == im_end
    assert tok.eos_token_ids == [im_end, eot]


def test_chat_template(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    assert tokenizer.apply_chat_template(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=False).endswith("héllo<|im_end|>\n")


def test_chat_template_missing_is_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer(_build(tmp_path, 300, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_folder_is_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer(tmp_path / "nope")


# ---- stop strings -------------------------------------------------------------------------------


def _stream(checker: StopChecker, pieces: list[str]) -> list[str]:
    out = []
    for p in pieces:
        out.append(checker.update(p))
        if checker.stopped:
            break
    if not checker.stopped:
        out.append(checker.flush())
    return out


def test_stop_checker_without_stop_strings_passes_deltas_through() -> None:
    """No stop strings: every delta is emitted as it comes (the fast path), exactly what the general path gives
    when no stop string can match; flush adds nothing and the output is the whole text."""
    deltas = ["héllo", " ", "", "日本", "語 🙂", " end"]
    for stop in (None, []):
        fast, general = StopChecker(stop), StopChecker(["\x00never"])
        got = [fast.update(d) for d in deltas]
        assert got == [general.update(d) for d in deltas] == deltas
        assert fast.flush() == general.flush() == ""
        assert fast.output_text == fast.text == "".join(deltas) and not fast.stopped


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(include: bool) -> None:
    c = StopChecker(["STOP"], include_stop_str_in_output=include)
    out = _stream(c, ["hello ", "wor", "ld ST", "OP and more"])
    assert c.stopped and c.stop_str == "STOP"
    expected = "hello world STOP" if include else "hello world "
    assert "".join(out) == c.output_text == expected


def test_stop_holdback_never_emits_stop_prefix() -> None:
    c = StopChecker(["</end>"])
    assert c.update("abc</") == "abc"  # "</" could begin "</end>"
    assert c.update("en") == ""
    assert c.update("x") == "</enx"  # not a stop after all: released
    assert c.update("</end>tail") == ""
    assert c.stopped and c.output_text == "abc</enx"


def test_stop_holdback_released_by_flush() -> None:
    c = StopChecker(["###"])
    assert c.update("value ##") == "value "
    assert c.flush() == "##"
    assert not c.stopped and c.output_text == "value ##"


def test_stop_first_completed_wins_independent_of_chunking() -> None:
    text = "xxabcdyy"
    stops = ["abcd", "bc"]  # "bc" completes first
    results = set()
    for chunking in ([text], list(text), ["xxa", "bcdyy"], ["xxabcd", "yy"]):
        c = StopChecker(stops)
        results.add(("".join(_stream(c, chunking)), c.stop_str))
    assert results == {("xxa", "bc")}


def test_stop_in_streaming_char_by_char_matches_whole() -> None:
    text = "The answer is 42.\n\nUser: next"
    for stops in (["\n\nUser:"], ["User", "\n\n"], ["zzz"]):
        whole = StopChecker(stops)
        w = "".join(_stream(whole, [text]))
        pieces = StopChecker(stops)
        p = "".join(_stream(pieces, list(text)))
        assert w == p == whole.output_text
    assert StopChecker.find_stop(text, ["\n\n", "zzz"]) == (17, 19, "\n\n")
