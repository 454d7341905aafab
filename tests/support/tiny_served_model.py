"""A tiny random Llama plus a matching byte-level BPE tokenizer with a chat template: a
complete model directory the serving stack can load (HTTP/gRPC integration tests)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.support.tiny_models import make_tiny_model

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")  # ids 0..5
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}{{- eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A serving cluster routes each request to the replica with the most free cache.",
    "Once upon a time there was a tiny model that told short stories about cats and dogs.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16.",
] * 20


def make_served_model(out: Path, vocab_size: int = 384,
                      weights: Callable[[Path, int], object] | None = None) -> Path:
    """The tokenizer, and the weights of a tiny Llama (or `weights(out, vocab_size)`'s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]),
    ])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    if weights is None:
        make_tiny_model("llama", out, vocab_size=tok.get_vocab_size())
    else:
        weights(out, tok.get_vocab_size())
    wrapped.save_pretrained(out)
    return out
