"""Streams a request's output text token by token, and finds its stop strings.

Two problems, two mechanisms:

1. Byte-level BPE splits multi-byte characters (emoji, CJK) across tokens, so a token may
   decode to U+FFFD on its own. We decode a small window with two offsets (as vLLM and
   TGI do):

       ids:   ... | prefix_offset ............ read_offset ............ end
                    <- already emitted, kept  -><- not yet emitted   ->
                       as left context

   prefix_text = decode(ids[prefix:read]), full_text = decode(ids[prefix:end]). When
   full_text is longer and does not end in U+FFFD (an incomplete character), the delta is
   full_text[len(prefix_text):] and both offsets move forward. Each step decodes a few
   tokens, never the whole output: O(1) per token. A few prompt tokens seed the window
   so that decoders that look at the left context (SentencePiece's leading space) see it.

2. Stop strings may span tokens and must not leak. After decoding, we hold back the
   longest suffix of the text that is still a proper prefix of some stop string; it is
   released as soon as it can no longer start one, or cut away when a stop matches.
   Matching only needs the last (max stop length - 1) characters plus the new text.

Text equals `tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
of the output ids: clean-up rewrites text across token boundaries (" ." -> "."), which no
stream can do without taking back text it already sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as left context; enough for any decoder's look-behind in practice.
_NUM_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerUpdate:
    text_delta: str  # new text safe to emit now
    stop_string: str | None  # the stop string that matched, if any (caller then finishes)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._backend = _raw_backend(tokenizer)

        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        # A prompt that ends mid-character would make the first output character look
        # like a continuation of the prompt's text; start without context then.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        # The window: ids[0] is the prefix offset (ids before it are dropped for good).
        self._ids: list[int] = context
        self._read_offset = len(context)

        # Stop-string state: the last (max_stop_len - 1) decoded characters, of which the
        # last `_num_held` have not been emitted yet.
        self._tail = ""
        self._num_held = 0

        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._finished = False

    # ------------------------------------------------------------------ public

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    def update(self, new_token_ids: list[int]) -> DetokenizerUpdate:
        if self._finished or not new_token_ids:
            return DetokenizerUpdate("", None)
        self._ids.extend(new_token_ids)
        return self._release(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """At finish without a stop string: everything held back (a trailing incomplete
        character decodes to U+FFFD here, exactly as a full decode would show it). Stop
        strings still apply: text from a stop string completed only by the flushed text
        on is cut (the caller is finishing anyway)."""
        if self._finished:
            return ""
        update = self._release(self._decode_window(final=True), final=True)
        self._finished = True
        return update.text_delta

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_window(self, final: bool) -> str:
        """New complete text since the last call ("" while a character is incomplete)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text):
            # e.g. a skipped special token: nothing visible yet, keep the window as is.
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        # Advance: what was unread becomes the left context of the next window.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    # ------------------------------------------------------------------ stop strings

    def _release(self, delta: str, final: bool) -> DetokenizerUpdate:
        if not self._stops:
            return self._emit(delta, None)
        if not delta and not (final and self._num_held):
            return DetokenizerUpdate("", None)

        buf = self._tail + delta
        boundary = len(self._tail)  # buf[boundary:] is new
        emit_start = boundary - self._num_held

        # Earliest stop string that ends inside the new text (anything ending earlier was
        # already checked). Ties on the start go to the shorter string.
        match_start = -1
        match_stop: str | None = None
        for stop in self._stops:
            i = buf.find(stop, max(0, boundary - len(stop) + 1))
            if i != -1 and (
                match_start == -1
                or i < match_start
                or (i == match_start and len(stop) < len(match_stop or ""))
            ):
                match_start, match_stop = i, stop
        if match_stop is not None:
            end = match_start + len(match_stop) if self._include_stop else match_start
            self._finished = True
            self._num_held = 0
            return self._emit(buf[emit_start : max(end, emit_start)], match_stop)

        if final or self._include_stop:
            # Nothing to hide: with include_stop_str_in_output a stop string is emitted
            # anyway, and the text after it is cut at match time.
            num_held = 0
        else:
            num_held = min(self._stop_prefix_suffix_len(buf), len(buf) - emit_start)
        emit_end = len(buf) - num_held
        self._num_held = num_held
        keep = self._max_stop_len - 1
        self._tail = buf[-keep:] if keep > 0 else ""
        return self._emit(buf[emit_start:emit_end], None)

    def _stop_prefix_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        if not buf:
            return 0
        last = buf[-1]
        best = 0
        for stop in self._stops:
            # Only prefixes ending in buf's last character can match; try longest first.
            j = stop.rfind(last, 0, len(stop) - 1)
            while j + 1 > best:
                if buf.endswith(stop[: j + 1]):
                    best = j + 1
                    break
                j = stop.rfind(last, 0, j)
        return best

    def _emit(self, text: str, stop: str | None) -> DetokenizerUpdate:
        if text:
            self._chunks.append(text)
            self._text_cache = None
        return DetokenizerUpdate(text, stop)


# transformers' fast-tokenizer `_decode` is the Rust `decode` plus optional clean-up (off
# here) behind layers of Python paid on every token; calling the Rust decode directly skips
# them. Subclasses that override `_decode` keep the slow path.
_PLAIN_FAST_DECODES = frozenset(
    {
        ("transformers.tokenization_utils_tokenizers", "TokenizersBackend._decode"),
        ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast._decode"),
    }
)


def _raw_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` to call directly, when that is exactly equivalent."""
    decode = getattr(type(tokenizer), "_decode", None)
    backend = getattr(tokenizer, "_tokenizer", None)
    if decode is None or backend is None or not hasattr(backend, "decode"):
        return None
    key = (getattr(decode, "__module__", ""), getattr(decode, "__qualname__", ""))
    return backend if key in _PLAIN_FAST_DECODES else None
