"""IncrementalDetokenizer: UTF-8 hold-back, equality with a full decode, stop strings."""
from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.outputs.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

REPLACEMENT = "\ufffd"
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Streaming text with emoji 😀🎉👍🏽 and families 👨‍👩‍👧 is fun.",
    "中文分词测试，你好世界。日本語のテキストも。한국어 텍스트",
    "STOP here. The end is near: ###END### and more text after.",
    "Numbers 12345 and symbols €£¥ ©®™ — “quotes”.",
] * 3


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE small enough that emoji and CJK characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
    )


class SlowPathTokenizer:
    """Wraps a tokenizer behind plain `decode` (forcing the generic path) and records
    how many ids each decode call sees."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def byte_token_ids(tokenizer: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """One token per raw byte, through the GPT-2 byte-to-unicode table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    ids = [tokenizer.convert_tokens_to_ids(table[b]) for b in data]
    assert all(isinstance(i, int) and i >= 0 for i in ids)
    return ids


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None
) -> tuple[list[DetokenizerUpdate], str]:
    """Feed `ids` (in chunks), stopping at a stop string; returns updates and flush()."""
    updates: list[DetokenizerUpdate] = []
    pos = 0
    step = 0
    while pos < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)] if chunk_sizes else 1
        update = detok.update(ids[pos : pos + size])
        updates.append(update)
        pos += size
        step += 1
        if update.stop_string is not None:
            return updates, ""
    return updates, detok.flush()


def joined(updates: list[DetokenizerUpdate]) -> str:
    return "".join(u.text_delta for u in updates)


# ---------------------------------------------------------------- plain decoding


def test_emoji_and_cjk_are_held_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Hi 😀🎉 中文分词 👨‍👩‍👧 한국어 ok"
    ids = tokenizer.encode(text)
    # The point of the test: some characters really are split across tokens.
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "))
    updates, tail = stream(detok, ids)
    assert all(REPLACEMENT not in u.text_delta for u in updates)
    assert any(u.text_delta == "" for u in updates)  # something was held back
    assert joined(updates) + tail == text == tokenizer.decode(ids)
    assert detok.text == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_token_sequences_match_full_decode(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool, seed: int
) -> None:
    """Random ids are mostly invalid UTF-8: the stream must still end up equal to a full
    decode, and nothing it emitted along the way may later turn out wrong."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
    output = [rng.randrange(vocab) for _ in range(200)]
    expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    chunk_sizes = [1] if seed % 2 == 0 else [1, 3, 2, 1, 5]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    updates, tail = stream(detok, output, chunk_sizes)
    emitted = ""
    for update in updates:
        # An incomplete character at the end is never emitted mid-stream...
        assert not update.text_delta.endswith(REPLACEMENT)
        emitted += update.text_delta
        # ...and what was emitted is final (a prefix of the full decode).
        assert expected.startswith(emitted)
    assert emitted + tail == expected
    assert detok.text == expected


def test_invalid_utf8_never_yields_garbage_mid_stream(tokenizer: PreTrainedTokenizerFast) -> None:
    emoji = "😀".encode()  # 4 bytes
    # First two bytes of an emoji, then ASCII: the two bytes are invalid for good.
    ids = byte_token_ids(tokenizer, emoji[:2]) + byte_token_ids(tokenizer, b"A")
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.update(ids[:1]).text_delta == ""
    assert detok.update(ids[1:2]).text_delta == ""
    assert detok.update(ids[2:]).text_delta == tokenizer.decode(ids) == REPLACEMENT + "A"

    # A stray continuation byte, then a valid emoji byte by byte.
    ids = byte_token_ids(tokenizer, b"\x9f" + emoji)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([i]).text_delta for i in ids]
    assert deltas[:-1] == ["", "", "", ""]
    assert deltas[-1] == REPLACEMENT + "😀" == tokenizer.decode(ids)

    # Ending on an incomplete character: held until flush, which shows it as a full
    # decode would.
    ids = byte_token_ids(tokenizer, b"ok" + emoji[:3])
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.update([i]).text_delta for i in ids) == "ok"
    assert detok.flush() == REPLACEMENT
    assert detok.text == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_prompt_ending_mid_character(tokenizer: PreTrainedTokenizerFast) -> None:
    emoji = "😀".encode()
    prompt = tokenizer.encode("Hi ") + byte_token_ids(tokenizer, emoji[:2])
    output = byte_token_ids(tokenizer, emoji[2:]) + tokenizer.encode(" yes")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    updates, tail = stream(detok, output)
    assert joined(updates) + tail == tokenizer.decode(output)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    output = tokenizer.encode("Hello") + [eos] + tokenizer.encode(" 😀 world") + [pad, eos]
    detok = IncrementalDetokenizer(
        tokenizer, [eos] + tokenizer.encode("prompt"), skip_special_tokens=skip_special_tokens
    )
    updates, tail = stream(detok, output)
    text = joined(updates) + tail
    assert text == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens:
        assert text == "Hello 😀 world"
    else:
        assert text == "Hello<|endoftext|> 😀 world<|pad|><|endoftext|>"


def test_cost_per_token_is_a_small_window(tokenizer: PreTrainedTokenizerFast) -> None:
    """No call decodes the whole output: windows stay a few tokens wide."""
    wrapped = SlowPathTokenizer(tokenizer)
    text = " ".join(CORPUS) * 4
    ids = tokenizer.encode(text)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(wrapped, tokenizer.encode("a prompt here"), stop=("@@@@",))
    updates, tail = stream(detok, ids)
    assert joined(updates) + tail == text
    assert max(wrapped.window_sizes) <= 16
    # Two decodes per token (prefix and full window), plus the context check.
    assert len(wrapped.window_sizes) <= 2 * len(ids) + 3


def test_fast_path_matches_generic_path(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(7)
    output = [rng.randrange(len(tokenizer)) for _ in range(300)]
    fast = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    slow = IncrementalDetokenizer(SlowPathTokenizer(tokenizer), [], skip_special_tokens=False)
    assert fast._backend is not None and slow._backend is None
    for token_id in output:
        assert fast.update([token_id]) == slow.update([token_id])
    assert fast.flush() == slow.flush()


# ---------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The end is near: ###END### and more text after."
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "###END###" not in pieces  # it really spans tokens
    detok = IncrementalDetokenizer(tokenizer, [], stop=("###END###",))
    updates, tail = stream(detok, ids)
    assert updates[-1].stop_string == "###END###"
    assert all(u.stop_string is None for u in updates[:-1])
    assert tail == ""
    assert joined(updates) == "The end is near: " == detok.text
    # The partial stop string was never emitted on the way.
    assert all("#" not in u.text_delta for u in updates)
    # After the stop, nothing more comes out.
    assert detok.update(tokenizer.encode(" more")) == DetokenizerUpdate("", None)
    assert detok.flush() == ""


def test_stop_string_included_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The end is near: ###END### and more text after."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(
        tokenizer, [], stop=("###END###",), include_stop_str_in_output=True
    )
    # Several tokens per update, so text after the stop arrives in the same update.
    updates, _ = stream(detok, ids, chunk_sizes=[4])
    assert updates[-1].stop_string == "###END###"
    assert joined(updates) == "The end is near: ###END###" == detok.text


def test_stop_string_in_first_token(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(" text here")
    first = tokenizer.decode(ids[:1])
    assert first == " text"
    stop = first[1:3]  # strictly inside the first token
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say: "), stop=(stop,))
    update = detok.update(ids[:1])
    assert update == DetokenizerUpdate(first[:1], stop)

    detok = IncrementalDetokenizer(
        tokenizer, [], stop=(first,), include_stop_str_in_output=True
    )
    assert detok.update(ids) == DetokenizerUpdate(first, first)


def test_partial_stop_is_held_then_released_on_mismatch(tokenizer: PreTrainedTokenizerFast) -> None:
    stop = "###END###"
    detok = IncrementalDetokenizer(tokenizer, [], stop=(stop,))
    first = detok.update(tokenizer.encode("near: ###"))
    assert first.text_delta == "near: "  # "###" could start the stop string
    second = detok.update(tokenizer.encode("EN"))
    assert second.text_delta == ""  # "###EN" still could
    third = detok.update(tokenizer.encode("X and"))
    assert third == DetokenizerUpdate("###ENX and", None)  # now it cannot: released
    # Held text at the end of the request comes out of flush().
    assert detok.update(tokenizer.encode(" ##")).text_delta == " "  # only "##" can start it
    assert detok.text == "near: ###ENX and "
    assert detok.flush() == "##"
    assert detok.text == "near: ###ENX and ##"


def test_earliest_of_several_stops_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The quick brown fox jumps"
    detok = IncrementalDetokenizer(tokenizer, [], stop=("fox", "quick", "jumps"))
    updates, _ = stream(detok, tokenizer.encode(text), chunk_sizes=[50])  # all at once
    assert updates[-1] == DetokenizerUpdate("The ", "quick")


def _unrelated(stops: list[str]) -> bool:
    """No stop is a substring of another: then "first to complete" and "first to start"
    agree, and the expected output is unambiguous."""
    return all(a == b or a not in b for a in stops for b in stops)


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_stop_strings_random(
    tokenizer: PreTrainedTokenizerFast, include_stop: bool, seed: int
) -> None:
    rng = random.Random(1000 + seed)
    alphabet = ["a", "b", "#", " ", "😀", "中", "END", "\n"]
    while True:
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        stops = list(dict.fromkeys(stops))
        if _unrelated(stops):
            break
    for trial in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            start, stop = min(hits)
            expected = text[: start + len(stop)] if include_stop else text[:start]
        else:
            stop, expected = None, text
        detok = IncrementalDetokenizer(
            tokenizer, [], stop=tuple(stops), include_stop_str_in_output=include_stop
        )
        updates, tail = stream(detok, ids, chunk_sizes=[1, 2, 1, 3] if trial % 2 else [1])
        emitted = ""
        for update in updates:
            emitted += update.text_delta
            assert expected.startswith(emitted), (stops, text)
        assert emitted + tail == expected, (stops, text)
        assert (updates[-1].stop_string if updates else None) == stop


@pytest.mark.parametrize("seed", range(4))
def test_text_at_end_is_the_streamed_text(tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    """A non-streamed request's processor decodes its tokens after the first once, at the
    end: the same text as one window per step, the first output's text at once (what a
    migration resumes from), nothing in between; a stop string keeps it per step."""
    from worker.api import RequestOutput, SamplingParams
    from worker.outputs.processor import RequestOutputProcessor

    rng = random.Random(seed)
    prompt = tokenizer.encode(CORPUS[seed])[:5]
    output = tokenizer.encode(CORPUS[seed + 1])[:40]
    sizes = [rng.choice([1, 1, 2, 3]) for _ in output]  # tokens per step

    def run(text_at_end: bool, stop: list[str] | None = None) -> list[str]:
        params = SamplingParams(max_tokens=len(output), stop=stop or [])
        processor = RequestOutputProcessor(tokenizer, prompt, params, text_at_end=text_at_end)
        deltas, i = [], 0
        for n in sizes:
            if i >= len(output):
                break
            ids = output[i:i + n]
            i += len(ids)
            out = RequestOutput("r", ids, finished=i >= len(output), finish_reason="length" if i >= len(output) else None)
            deltas.append(processor.process(out).text_delta)
            if processor.stopped:
                break
        return deltas

    streamed, at_end = run(False), run(True)
    assert "".join(at_end) == "".join(streamed) == tokenizer.decode(output)
    assert at_end[0] == streamed[0] and not any(at_end[1:-1])
    stop = CORPUS[seed + 1][10:14]
    assert run(True, [stop]) and "".join(run(True, [stop])) == "".join(run(False, [stop]))
