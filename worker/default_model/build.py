"""Build the embedded default model, `kvserve-tiny`, from nothing.

    python -m worker.default_model.build [--out DIR] [--steps N]

Produces a Hugging Face model directory (safetensors weights in float32, config,
generation config, tokenizer files with a chat template) without any download:

1. a synthetic English corpus from `corpus.py` (seeded templates);
2. a byte-level BPE tokenizer trained on it with the `tokenizers` library, so that any
   string, emoji and other non-ASCII text included, round-trips through bytes;
3. a small `LlamaForCausalLM` trained on it with plain torch on CPU for a fixed number
   of steps (minutes, not hours, on a laptop-class CPU), so that greedy decoding answers in
   readable English and stops with EOS.

Everything is seeded and the data order is fixed; the step count, not a wall-clock
budget, ends training, so the same machine builds the same files. (Across CPUs with
different vector units float rounding may differ; the committed files are the reference.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from worker.default_model.corpus import MODEL_NAME, Document, generate_corpus

SEED = 1234
# An upper bound: BPE stops merging when no pair occurs twice, and the narrow synthetic
# corpus runs out of such pairs below it. Unseen text still encodes (byte fallback).
VOCAB_SIZE = 2048
# More than the default steps consume (DEFAULT_STEPS x BATCH_SIZE packed rows), so no
# document repeats.
NUM_DOCUMENTS = 24_000
SEQUENCE_LENGTH = 256
# Small batches, more steps: for a model this small on a few CPU cores a bigger batch
# does not raise tokens per second, and a tiny budget learns more from more updates.
BATCH_SIZE = 8
DEFAULT_STEPS = 320
PEAK_LEARNING_RATE = 5e-3
WARMUP_STEPS = 30

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Order fixes the ids: bos=0, eos=1, pad=2, then the role markers.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# Every message is `<|role|>\n content <|eos|>`; the generation prompt opens an assistant
# turn. Because EOS closes every turn, the model's natural "end of answer" is the
# config's eos_token_id, so a server stops on it with no extra stop strings.
# Content may be a string or an OpenAI-style list of parts; only text parts are kept.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    # Tools (Hermes format; rendered only when a request has tools, so the template the
    # model was trained with is unchanged without them).
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' -}}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('kvserve-tiny supports the roles system, user, assistant and tool, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}{{- '<|user|>\\n<tool_response>\\n' -}}"
    "{%- else -%}{{- '<|' + message['role'] + '|>\\n' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}{{- '\\n</tool_response>' -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
    "{{- (fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

DEFAULT_OUT = Path(__file__).resolve().parent / "files"


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, wrapped for transformers."""
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every byte has a token, so no input is ever unknown (no unk token).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Plain encoding (completions) starts with BOS like Llama's tokenizers; the chat
    # template writes BOS itself and is tokenized without special tokens.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def corpus_texts(documents: list[Document]) -> list[str]:
    """The raw strings of a corpus, for tokenizer training (role markers excluded)."""
    texts: list[str] = []
    for document in documents:
        if document.text is not None:
            texts.append(document.text)
        else:
            assert document.turns is not None
            texts.extend(content for _, content in document.turns)
    return texts


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: list[Document]) -> list[list[int]]:
    """Token ids of each document: BOS ... EOS, dialogues through the chat template."""
    # Rendering is done once as strings and tokenized in one batch call (fast path).
    rendered: list[str] = []
    for document in documents:
        if document.text is not None:
            rendered.append(f"{BOS_TOKEN}{document.text}{EOS_TOKEN}")
        else:
            assert document.turns is not None
            messages = [{"role": role, "content": content} for role, content in document.turns]
            rendered.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def pack_rows(encoded: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedily pack whole documents into rows of SEQUENCE_LENGTH tokens.

    Every row starts at a document's BOS (position 0, as at inference); documents never
    straddle rows. The tail of a row is padding whose labels are -100. Padding sits only
    after real tokens, so the causal mask alone keeps it out of every real token's
    attention and no attention mask is needed.
    """
    rows: list[list[int]] = []
    current: list[int] = []
    for ids in encoded:
        ids = ids[:SEQUENCE_LENGTH]
        if len(current) + len(ids) > SEQUENCE_LENGTH:
            rows.append(current)
            current = []
        current.extend(ids)
    if current:
        rows.append(current)
    input_ids = torch.full((len(rows), SEQUENCE_LENGTH), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), SEQUENCE_LENGTH), -100, dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row)
        labels[index, : len(row)] = torch.tensor(row)
    return input_ids, labels


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """About one million parameters: 4 MB in float32, still a real GQA Llama."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        # Fewer KV heads than query heads, so the engine's grouped-query path is exercised.
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def learning_rate(step: int, num_steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < WARMUP_STEPS:
        return PEAK_LEARNING_RATE * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, num_steps - WARMUP_STEPS)
    return PEAK_LEARNING_RATE * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor, num_steps: int
) -> float:
    """Plain AdamW on CPU; returns the mean loss of the last 20 steps."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=PEAK_LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.01
    )
    # Fixed data order: a seeded permutation, repeated (re-permuted) if steps outrun rows.
    generator = torch.Generator().manual_seed(SEED)
    order = torch.randperm(input_ids.shape[0], generator=generator)
    cursor = 0
    recent_losses: list[float] = []
    model.train()
    started = time.monotonic()
    for step in range(num_steps):
        if cursor + BATCH_SIZE > order.numel():
            order = torch.randperm(input_ids.shape[0], generator=generator)
            cursor = 0
        batch = order[cursor : cursor + BATCH_SIZE]
        cursor += BATCH_SIZE
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, num_steps)
        loss = model(input_ids=input_ids[batch], labels=labels[batch]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent_losses = (recent_losses + [loss.item()])[-20:]
        if step % 25 == 0 or step == num_steps - 1:
            print(
                f"step {step:4d}/{num_steps}  loss {loss.item():.3f}  "
                f"lr {learning_rate(step, num_steps):.2e}  {time.monotonic() - started:6.1f}s",
                flush=True,
            )
    model.eval()
    return sum(recent_losses) / len(recent_losses)


def build(out: Path, num_steps: int) -> dict[str, object]:
    """Build the model directory at `out` (replacing it) and return build facts."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    # Same results on every run of the same machine. One thread: the thread count changes
    # the order of float reductions, so it is pinned; and a model this small has ops too
    # small to split, so extra threads only add spin waits (worse on a busy machine).
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    documents = generate_corpus(NUM_DOCUMENTS, SEED)
    tokenizer = build_tokenizer(corpus_texts(documents))
    encoded = encode_documents(tokenizer, documents)
    input_ids, labels = pack_rows(encoded, tokenizer.pad_token_id)
    num_tokens = int((labels != -100).sum())
    print(
        f"corpus: {len(documents)} documents, {num_tokens} tokens in {input_ids.shape[0]} rows; "
        f"vocab {len(tokenizer)}",
        flush=True,
    )

    config = model_config(tokenizer)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    print(f"model: {num_parameters} parameters", flush=True)

    started = time.monotonic()
    final_loss = train(model, input_ids, labels, num_steps)
    training_seconds = time.monotonic() - started

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    # Write next to the target, then swap, so a failed build never leaves a half directory.
    staging = out.with_name(out.name + ".staging")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    facts: dict[str, object] = {
        "name": MODEL_NAME,
        "seed": SEED,
        "num_documents": len(documents),
        "num_training_tokens": num_tokens,
        "num_steps": num_steps,
        "batch_size": BATCH_SIZE,
        "sequence_length": SEQUENCE_LENGTH,
        "num_parameters": num_parameters,
        "final_loss": round(final_loss, 4),
        "torch_version": torch.__version__,
    }
    # Wall-clock time is left out of the file so that rebuilds are byte-identical.
    (staging / "build_info.json").write_text(json.dumps(facts, indent=2) + "\n")
    # save_pretrained writes the weights owner-only; these files are shipped, so make
    # every file world-readable like the rest of the source tree.
    for path in staging.iterdir():
        path.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    facts["training_seconds"] = round(training_seconds, 1)
    return facts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Build the embedded default model {MODEL_NAME}.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (replaced)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    args = parser.parse_args(argv)
    facts = build(args.out.resolve(), args.steps)
    print(json.dumps(facts, indent=2))


if __name__ == "__main__":
    main()
