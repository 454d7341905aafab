"""OpenAI request validation and conversion, without Ray: bodies -> engine inputs,
engine outputs -> bodies and stream chunks, error bodies, metrics text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from router import errors
from router.frontend.openai_api import convert as convert
from router.frontend.openai_api import protocol as p
from router.frontend.generation import InFlightLimiter, api_error_of
from router.frontend.metrics import IngressMetrics
from worker.api import RequestError, RequestOutput, TokenLogprob


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from transformers import AutoTokenizer

    from tests.support.tiny_served_model import make_served_model

    path = make_served_model(tmp_path_factory.mktemp("tok") / "m")
    return AutoTokenizer.from_pretrained(Path(path))


def validation_error(model: type, body: dict) -> errors.APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return errors.from_validation_error(info.value)


def test_unknown_field_is_reported_like_openai() -> None:
    error = validation_error(p.CompletionRequest, {"model": "m", "prompt": "x", "frobnicate": 1})
    assert error.status == 400 and error.param == "frobnicate"
    assert error.message == "Unrecognized request argument supplied: frobnicate"


def test_unknown_field_in_a_message() -> None:
    error = validation_error(p.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x", "mood": 1}]})
    assert error.param == "messages.0.mood"


def test_missing_and_out_of_range() -> None:
    assert validation_error(p.CompletionRequest, {"model": "m"}).param == "prompt"
    assert validation_error(p.CompletionRequest, {"model": "m", "prompt": "x", "temperature": 2.5}).param == "temperature"
    assert validation_error(p.ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"


@pytest.mark.parametrize(
    "extra",
    [{"top_logprobs": 2}, {"functions": [{"name": "f"}]}],
)
def test_known_but_unsupported_chat_fields_are_400(extra: dict) -> None:
    error = validation_error(p.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert error.status == 400 and error.param is None


def test_a_malformed_tool_is_400_naming_it() -> None:
    error = validation_error(p.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})
    assert error.status == 400 and error.param == "tools.0.function"


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    req = p.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
         "response_format": {"type": "text"}, "store": False, "metadata": {"k": "v"}, "user": "u"}
    )
    assert req.tools == []


def test_completion_inputs(tokenizer) -> None:  # noqa: ANN001
    req = p.CompletionRequest.model_validate(
        {"model": "m", "prompt": ["Hello", "Hello world"], "n": 2, "max_tokens": 5, "seed": 10, "stop": "x",
         "top_k": -1, "logprobs": 3, "ignore_eos": True, "stop_token_ids": [7]}
    )
    inputs = convert.completion_inputs(req, tokenizer, max_model_len=64, max_n=4)
    assert [i.index for i in inputs] == [0, 1, 2, 3]
    assert [i.prompt_index for i in inputs] == [0, 0, 1, 1]
    assert inputs[0].prompt_token_ids == tokenizer("Hello").input_ids
    assert [i.params.seed for i in inputs] == [10, 11, 10, 11]  # seed + choice index
    params = inputs[0].params
    assert (params.max_tokens, params.stop, params.top_k, params.logprobs, params.ignore_eos, params.stop_token_ids) == (
        5, ("x",), 0, 3, True, (7,),
    )


def test_logit_bias_reaches_sampling_params(tokenizer) -> None:  # noqa: ANN001
    req = p.CompletionRequest.model_validate({"model": "m", "prompt": "Hello", "logit_bias": {"5": 100, "7": -100.0}})
    [inp] = convert.completion_inputs(req, tokenizer, 64, 4)
    assert inp.params.logit_bias == ((5, 100.0), (7, -100.0))


@pytest.mark.parametrize("bias", [{"5": 100.5}, {"5": -101}, {"x": 1.0}, {"-3": 1.0}])
def test_logit_bias_out_of_range_or_not_an_id_is_400(bias: dict) -> None:
    error = validation_error(p.CompletionRequest, {"model": "m", "prompt": "x", "logit_bias": bias})
    assert error.status == 400 and error.param == "logit_bias"


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_token_ids_outside_the_vocabulary_are_400(tokenizer, field: str) -> None:  # noqa: ANN001
    value = {str(len(tokenizer)): 1.0} if field == "logit_bias" else [len(tokenizer)]
    req = p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], field: value})
    with pytest.raises(errors.APIError) as info:
        convert.chat_inputs(req, tokenizer, 64, 4)
    assert info.value.status == 400 and info.value.param == field and "outside the vocabulary" in info.value.message


def test_token_id_prompt_is_used_as_is(tokenizer) -> None:  # noqa: ANN001
    req = p.CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3]})
    assert convert.completion_inputs(req, tokenizer, 64, 4)[0].prompt_token_ids == [1, 2, 3]


def test_chat_inputs_use_the_template_and_default_max_tokens(tokenizer) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]
    req = p.ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "logprobs": True, "top_logprobs": 2})
    [inp] = convert.chat_inputs(req, tokenizer, max_model_len=100, max_n=4)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True)
    assert inp.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert inp.params.max_tokens == 100 - len(inp.prompt_token_ids)
    assert inp.params.logprobs == 2


def test_length_and_n_limits(tokenizer) -> None:  # noqa: ANN001
    req = p.CompletionRequest.model_validate({"model": "m", "prompt": "Hello", "max_tokens": 100})
    with pytest.raises(errors.APIError) as info:
        convert.completion_inputs(req, tokenizer, max_model_len=50, max_n=4)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    req = p.CompletionRequest.model_validate({"model": "m", "prompt": "Hello", "n": 5})
    with pytest.raises(errors.APIError) as info:
        convert.completion_inputs(req, tokenizer, max_model_len=50, max_n=4)
    assert info.value.param == "n"


def out(index: int, text: str, n: int, finished: bool = False, logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=f"r-{index}", new_token_ids=[5], text_delta=text, finished=finished,
        finish_reason="length" if finished else None, logprobs=logprobs, num_prompt_tokens=3, num_output_tokens=n,
    )


def test_chat_response_and_usage(tokenizer) -> None:  # noqa: ANN001
    texts = convert.TokenTexts(tokenizer)
    states = [convert.ChoiceState(0, 0), convert.ChoiceState(1, 0)]
    for o in (out(0, "He", 1), out(1, "Yo", 1), out(0, "llo", 2, True), out(1, "!", 2, True)):
        states[int(o.request_id[-1])].add(o)
    usage = convert.usage_of(states, [3])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)
    body = convert.ChatFormatter("id", "m", texts, False).response(states, usage).model_dump()
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "Yo!"]
    assert body["choices"][0]["finish_reason"] == "length"


def test_stream_chunks_are_openai_shaped(tokenizer) -> None:  # noqa: ANN001
    texts = convert.TokenTexts(tokenizer)
    chat = convert.ChatFormatter("id", "m", texts, True)
    [start] = chat.start_chunks([0])
    assert json.loads(convert.sse(start).removeprefix("data: "))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    lp = [TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0)))]
    event = convert.sse(chat.delta_chunk(0, out(0, "Hi", 1, logprobs=lp)))
    assert event.startswith("data: ") and event.endswith("\n\n")
    chunk = json.loads(event.removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["finish_reason"] is None  # present, as OpenAI sends it
    assert len(chunk["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert "usage" not in chunk
    completion = convert.CompletionFormatter("id", "m", texts, True)
    first = completion.delta_chunk(0, out(0, "ab", 1, logprobs=lp))
    second = completion.delta_chunk(0, out(0, "c", 2, True, logprobs=lp))
    assert first.choices[0].logprobs.text_offset == [0]
    assert second.choices[0].logprobs.text_offset == [len(texts(5))]
    assert second.choices[0].finish_reason == "length"
    assert convert.SSE_DONE == "data: [DONE]\n\n"


def test_worker_errors_map_to_statuses() -> None:
    assert api_error_of(RequestError("prompt too long")).status == 400

    class BackPressureError(Exception):
        pass

    assert api_error_of(BackPressureError()).status == 429
    assert api_error_of(RuntimeError("boom")).status == 500


def test_limiter_bounds_and_releases() -> None:
    limiter = InFlightLimiter(3)
    a = limiter.acquire(2)
    with pytest.raises(errors.APIError) as info:
        limiter.acquire(2)
    assert info.value.status == 429
    a.release()
    a.release()  # idempotent
    assert limiter.in_flight == 0
    big = limiter.acquire(10)  # heavier than the bound: runs alone
    assert limiter.in_flight == 3
    big.release()


def test_metrics_text_has_vllm_names() -> None:
    metrics = IngressMetrics("m")
    metrics.observe_first_token(0.05)
    metrics.observe_inter_token(0.02, 2)
    metrics.observe_finished(1.0, 10, 5, "length")
    stats = [
        {"replica_id": "a", "num_running": 2, "num_waiting": 1, "kv_usage": 0.5, "free_blocks": 8, "total_blocks": 16,
         "prefix_cache_queries": 100, "prefix_cache_hits": 40, "num_preemptions": 1, "tokens_per_s": 3.0},
        {"replica_id": "b", "num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "free_blocks": 16, "total_blocks": 16,
         "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "tokens_per_s": 0.0},
    ]
    text = metrics.render(stats).decode()
    assert 'kvserve:num_requests_running{model_name="m",replica="a"} 2.0' in text
    assert 'kvserve:prefix_cache_hits_total{model_name="m",replica="a"} 40.0' in text
    assert 'kvserve:cluster_kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'kvserve:cluster_num_requests_waiting{model_name="m"} 1.0' in text
    assert 'kvserve:prompt_tokens_total{model_name="m"} 10.0' in text
    assert 'kvserve:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert "kvserve:time_to_first_token_seconds_bucket" in text and "kvserve:e2e_request_latency_seconds_bucket" in text


@pytest.mark.parametrize("text, finished, reason, stop_reason", [
    ("Hel", False, None, None), ("lo é✓ \"q\"\n", False, None, None), ("!", True, "length", None),
    ("", True, "stop", None), ("", True, "stop", "END"), ("x", True, "stop", 7), ("", True, "abort", None),
    ("", False, None, None),
])
def test_plain_stream_events_are_the_models_bytes(text: str, finished: bool, reason: str | None,
                                                  stop_reason: str | int | None) -> None:
    # The fast path (a dict, no models) writes exactly what the models would.
    o = RequestOutput(request_id="r-0", new_token_ids=[5] if text else [], text_delta=text, finished=finished,
                      finish_reason=reason, stop_reason=stop_reason)
    for formatter in (convert.CompletionFormatter("cmpl-1", "m", None, False), convert.ChatFormatter("chat-1", "m", None, False)):
        chunk = formatter.delta_chunk(2, o)
        assert formatter.delta_event(2, o) == (None if chunk is None else convert.sse(chunk))


def test_harmony_and_mistral_outputs_keep_special_tokens(tokenizer) -> None:  # noqa: ANN001
    """Their markers are special tokens: the engine must decode them. Not for a
    grammar-held output (no markers there), nor for other templates."""
    import copy

    messages = [{"role": "user", "content": "Hi"}]
    plain = p.ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    assert convert.chat_inputs(plain, tokenizer, 100, 4, reasoning_parser="auto")[0].params.skip_special_tokens
    harmony = copy.deepcopy(tokenizer)
    harmony.chat_template = tokenizer.chat_template.replace("<|assistant|>", "<|start|>assistant<|channel|>")
    assert not convert.chat_inputs(plain, harmony, 100, 4, reasoning_parser="auto")[0].params.skip_special_tokens
    assert convert.chat_inputs(plain, harmony, 100, 4, reasoning_parser="none")[0].params.skip_special_tokens
    structured = p.ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "response_format": {"type": "json_object"}})
    assert convert.chat_inputs(structured, harmony, 100, 4, reasoning_parser="auto")[0].params.skip_special_tokens
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    mistral = p.ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    assert not convert.chat_inputs(mistral, tokenizer, 100, 4, tool_parser="mistral")[0].params.skip_special_tokens
    assert convert.chat_inputs(mistral, tokenizer, 100, 4, tool_parser="hermes")[0].params.skip_special_tokens
