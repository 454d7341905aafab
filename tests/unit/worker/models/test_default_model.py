"""The embedded default model loads offline, chats, stops with EOS and round-trips bytes.

These tests read the committed files under worker/default_model/files/; they never
train (the build takes minutes) and never touch the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import worker.default_model as default_model
from worker.default_model import DEFAULT_MODEL_NAME, default_model_path
from worker.default_model.build import CHAT_TEMPLATE, build_tokenizer, corpus_texts
from worker.default_model.corpus import generate_corpus

MAX_NEW_TOKENS = 100


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Forbid hub access (and point the cache at an empty folder) while loading."""
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("TRANSFORMERS_OFFLINE", "1")
    patch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def tokenizer(offline: None) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


@pytest.fixture(scope="module")
def model(offline: None) -> PreTrainedModel:
    loaded = AutoModelForCausalLM.from_pretrained(default_model_path(), local_files_only=True)
    loaded.eval()
    return loaded


def _printable(text: str) -> bool:
    return all(character.isprintable() or character in "\n\t" for character in text)


def test_path_points_at_a_model_directory() -> None:
    path = Path(default_model_path())
    assert DEFAULT_MODEL_NAME == "kvserve-tiny"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    # Committed to the repository: keep it small.
    total_bytes = sum(file.stat().st_size for file in path.iterdir())
    assert total_bytes < 5 * 1024 * 1024


def test_missing_files_raise_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(default_model, "_FILES_DIR", tmp_path / "files")
    with pytest.raises(FileNotFoundError, match=r"python -m worker\.default_model\.build"):
        default_model.default_model_path()


def test_config_is_a_small_gqa_llama(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert next(model.parameters()).dtype == torch.float32
    assert sum(parameter.numel() for parameter in model.parameters()) < 2_000_000


def test_chat_template_renders(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|system|>\nBe brief.<|eos|><|user|>\nHi!<|eos|><|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    # The template writes BOS itself: exactly one, first, and the role markers are single tokens.
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in ids
    # OpenAI-style content parts render as their text.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|bos|><|user|>\nHi!<|eos|>"


def test_chat_template_rejects_unknown_roles(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="supports the roles"):
        tokenizer.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_chat_template_renders_tools_in_hermes_format(tokenizer: PreTrainedTokenizerBase) -> None:
    """Tools, an assistant's tool call and the tool's answer (router/frontend/tool_calling/parsers.py's
    hermes parser reads the same <tool_call> format back)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<|assistant|>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|eos|>' in text
    assert text.endswith("<|user|>\n<tool_response>\nsunny\n</tool_response><|eos|><|assistant|>\n")


def test_plain_encoding_starts_with_bos(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("Once upon a time")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Once upon a time"


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and trailing spaces  \n\ttabs",
        "Grüße aus Köln, naïve café, Ελληνικά, русский, 日本語, 한국어, العربية",
        "emoji: 🙂🚀👩‍👩‍👧 and a flag 🇩🇪",
        "code: def f(x): return x ** 2  # ∑ ≤ ∞",
        "\x00 control \x7f bytes",
    ],
)
def test_tokenizer_round_trips_any_text(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "user", "content": "Tell me a short story."}],
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Why is the sky blue? Explain in detail."},
        ],
    ],
)
def test_greedy_chat_generation_stops_with_eos(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> None:
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    new_ids = output[0, prompt.shape[1] :].tolist()
    assert tokenizer.eos_token_id in new_ids, tokenizer.decode(new_ids)
    answer = tokenizer.decode(new_ids[: new_ids.index(tokenizer.eos_token_id)])
    assert len(answer.split()) >= 2 and _printable(answer), answer
    assert answer.isascii(), answer


def test_greedy_plain_completion_stops_with_eos(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompt = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        output = model.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    new_ids = output[0, prompt.shape[1] :].tolist()
    assert tokenizer.eos_token_id in new_ids
    assert _printable(tokenizer.decode(new_ids, skip_special_tokens=True))


def test_greedy_generation_is_deterministic(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompt = tokenizer("The little cat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = model.generate(prompt, max_new_tokens=20, do_sample=False)
        second = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(first, second)


def test_corpus_and_tokenizer_training_are_deterministic() -> None:
    # The build's inputs: same seed, same documents; same texts, same tokenizer.
    documents = generate_corpus(300, seed=7)
    assert documents == generate_corpus(300, seed=7)
    assert documents != generate_corpus(300, seed=8)
    texts = corpus_texts(documents)
    first, second = build_tokenizer(texts), build_tokenizer(texts)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert first.chat_template == CHAT_TEMPLATE
