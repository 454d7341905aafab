"""Compiles structured-output specs into llguidance matchers off the step thread.

    add_request ──submit(spec)──> thread pool: grammar_of(spec) + LLMatcher(tokenizer, grammar)
                                  (an LRU cache of futures keyed by the spec: the same
                                  schema compiles once; every request deep-copies it)
    engine step: a request whose future is done enters the scheduler; until then it
                 waits, and the step thread never waits on a compile.

The llguidance tokenizer (built from the model's HF tokenizer: slow for a large
vocabulary, too slow for the step thread) is built on the pool too: started from the
replica's own tokenizer when the replica is ready (`prewarm`, not waited for), so that only
a grammar request arriving before it ends waits, for the rest of it; without a prewarm, by
the first compile.
"""
from __future__ import annotations

import importlib.util
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from worker.api import StructuredOutput, load_tokenizer
from worker.structured.grammar import GrammarError, grammar_of, llguidance_module

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
# A request whose grammar has not compiled by then fails: llguidance bounds a compile's work
# (its parser limits' fuel), but a compile queued behind others, or a tokenizer build that
# hangs, must not hold the request (nor every later constrained one) forever.
DEFAULT_COMPILE_TIMEOUT_S = 30.0


class GrammarCompiler:
    def __init__(
        self,
        make_tokenizer: Callable[[], Any],  # -> llguidance.LLTokenizer
        max_cached: int = DEFAULT_CACHE_SIZE,
        max_workers: int = 1,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._make_tokenizer = make_tokenizer
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._prewarm: Future[Any] | None = None
        self.hf_tokenizer: Any = None  # the model's tokenizer, when this compiler loaded it
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvserve-grammar")
        self._cache: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.num_compiles = 0  # cache misses (for tests and stats)

    @classmethod
    def for_hf_tokenizer(cls, hf_tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        return cls(lambda: _llguidance_tokenizer(hf_tokenizer, vocab_size))

    @classmethod
    def for_model_path(cls, path: Path | str, vocab_size: int, trust_remote_code: bool = False) -> GrammarCompiler:
        """The model's tokenizer is loaded by worker.api.load_tokenizer, the loader the
        ingress and the replica use: the grammar's vocabulary must be the very one the
        prompt was tokenized and the output is detokenized with, whatever the model's
        format (a directory, a single .gguf file)."""
        compiler = cls(lambda: None)

        def make() -> Any:
            if compiler.hf_tokenizer is None:  # the replica's, when prewarm was handed it
                compiler.hf_tokenizer = load_tokenizer(path, trust_remote_code)
            return _llguidance_tokenizer(compiler.hf_tokenizer, vocab_size)

        compiler._make_tokenizer = make
        return compiler

    def submit(self, so: StructuredOutput) -> Future[Any]:
        """A future of the spec's compiled matcher (a prototype: deep-copy it per
        request). Never blocks on the compile."""
        with self._lock:
            future = self._cache.get(so)
            if future is not None:
                self._cache.move_to_end(so)
                return future
            future = self._pool.submit(self._compile, so)
            self.num_compiles += 1
            self._cache[so] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def prewarm(self, hf_tokenizer: Any = None) -> Future[Any] | None:
        """Start building the llguidance tokenizer on the pool now, from `hf_tokenizer` (the
        replica's own: loaded once) or one it loads; compiles queue behind it. A replica
        starts it when it is ready and does not wait for it. None when llguidance is not
        installed (a grammar request then fails with the install hint)."""
        if importlib.util.find_spec("llguidance") is None:
            return None
        if hf_tokenizer is not None:
            self.hf_tokenizer = hf_tokenizer
        self._prewarm = self._pool.submit(self.tokenizer)
        return self._prewarm

    def wait_prewarmed(self, timeout_s: float | None = None) -> Any:
        """Wait for the prewarm (if one runs); the model's tokenizer it loaded once it is
        done (None: no prewarm, or it failed or is slow, which is logged, not raised: the
        replica serves on, and a grammar request then fails or waits as without it)."""
        if self._prewarm is None:
            return None
        try:
            self._prewarm.result(timeout=timeout_s if timeout_s is not None else self.compile_timeout_s)
        except Exception as e:  # noqa: BLE001 -- reported; grammar requests surface it
            logger.warning("structured-output tokenizer not ready at start: %r", e)
            return None
        return self.hf_tokenizer

    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _compile(self, so: StructuredOutput) -> Any:
        grammar = grammar_of(so)
        # LLMatcher drops the GIL while it builds the grammar.
        matcher = llguidance_module().LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {so.kind.replace('_', ' ')}: {matcher.get_error()}")
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _llguidance_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer for an HF one; `vocab_size` is the model's (its logits'
    width), which may exceed the tokenizer's own length (padded embeddings)."""
    import llguidance.hf  # llguidance: only a grammar needs it (install hint in grammar.py)

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
