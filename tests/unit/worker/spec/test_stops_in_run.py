"""A verified run of several tokens ends where a single-token step would have: at a stop
token, EOS or max_tokens inside the run (the engine), at a stop string completed by one of
its tokens (the output processor)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.unit.worker.spec.test_spec_vs_hf import MAX_TOKENS, PROMPTS, _engine
from worker.api import RequestOutput, SamplingParams
from worker.outputs.processor import RequestOutputProcessor

if TYPE_CHECKING:
    from tests.conftest import HFReference, TinyModels


def test_stop_tokens_inside_accepted_runs(tiny_model: TinyModels, hf_reference: HFReference,
                                          run_engine: Callable) -> None:
    """Each request stops at a token from the middle of its greedy output (its first
    occurrence): with drafts the output, its finish reason and its count are the plain
    engine's."""
    indices = [i for i in range(len(PROMPTS)) if MAX_TOKENS[i] >= 12]
    refs = hf_reference("llama", [PROMPTS[i] for i in indices], [MAX_TOKENS[i] for i in indices])
    params = [SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, stop_token_ids=(ref[len(ref) // 2],))
              for i, ref in zip(indices, refs)]
    prompts = [PROMPTS[i] for i in indices]
    results = []
    for spec in (True, False):
        engine = _engine(tiny_model("llama"), spec=spec)
        finals: dict[str, RequestOutput] = {}
        results.append((run_engine(engine, prompts, params, final_outputs=finals),
                        {rid: (o.finish_reason, o.stop_reason, o.num_output_tokens) for rid, o in finals.items()}))
        if spec:
            assert engine.stats().num_accepted_draft_tokens > 0
    assert results[0] == results[1]
    for rid, ref in zip(results[0][0], refs):
        stop = ref[len(ref) // 2]
        assert results[0][0][rid] == ref[:ref.index(stop) + 1]
        assert results[0][1][rid][:2] == ("stop", stop)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    corpus = ["the cat sat on the mat. END of story; the dog ran off, END again!"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def _outputs(tokenizer: PreTrainedTokenizerFast, ids: list[int], sizes: list[int],
             params: SamplingParams) -> tuple[str, list[int], RequestOutput]:
    processor = RequestOutputProcessor(tokenizer, tokenizer.encode("prompt:"), params)
    text, tokens, start, out = "", [], 0, None
    for size in sizes:
        chunk = ids[start:start + size]
        start += size
        out = processor.process(RequestOutput("r", chunk, num_output_tokens=start, finished=start >= len(ids),
                                              finish_reason="length" if start >= len(ids) else None))
        text += out.text_delta
        tokens += out.new_token_ids
        if out.finished:
            break
    assert out is not None
    return text, tokens, out


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_a_run_at_its_token(tokenizer: PreTrainedTokenizerFast, include: bool) -> None:
    ids = tokenizer.encode("the cat sat on the mat. END of story; the dog ran off")
    params = SamplingParams(max_tokens=100, stop=("END",), include_stop_str_in_output=include)
    one_by_one = _outputs(tokenizer, ids, [1] * len(ids), params)
    assert one_by_one[2].finish_reason == "stop" and len(one_by_one[1]) < len(ids)
    for sizes in ([5] * 20, [3, 7, 11, 40], [len(ids)]):
        text, tokens, last = _outputs(tokenizer, ids, sizes, params)
        assert (text, tokens) == one_by_one[:2]
        assert (last.finish_reason, last.stop_reason) == ("stop", "END")
        assert last.num_output_tokens == len(tokens)
