"""Request migration without Ray: a fake worker handle whose 'replica' dies mid-stream; the
stream resumes on the next call with prompt + generated tokens and stays identical to an
undisturbed run. Plus the worker side: the detokenizer replay keeps text deltas seamless."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from router import errors
from router.frontend.generation import GenerationStream, InFlightLimiter, api_error_of
from router.frontend.key_limits import JointPermit
from router.frontend.metrics import IngressMetrics
from router.frontend.migration import Migration, is_replica_failure
from router.frontend.openai_api.convert import EngineInput
from worker.outputs.processor import RequestOutputProcessor
from worker.api import GenerateRequest, ReplicaDrainingError, RequestOutput, SamplingParams


class ActorDiedError(RuntimeError):
    """Named like ray.exceptions.ActorDiedError (matched by name)."""


class RayTaskError(RuntimeError):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def next_token(tokens: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of the whole context."""
    return 10 + (sum(tokens[-3:]) * 7 + len(tokens)) % 50


class FakeCall:
    def __init__(self, request: GenerateRequest, die_after: int | None, error: BaseException) -> None:
        self.request = request
        self.die_after = die_after
        self.error = error
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        context = list(self.request.prompt_token_ids)
        n = self.request.params.max_tokens
        for i in range(n):
            if self.die_after is not None and i == self.die_after:
                raise self.error
            await asyncio.sleep(0)
            token = next_token(context)
            context.append(token)
            yield RequestOutput(
                request_id=self.request.request_id,
                new_token_ids=[token],
                finished=i == n - 1,
                finish_reason="length" if i == n - 1 else None,
                num_prompt_tokens=len(self.request.prompt_token_ids),
                num_output_tokens=i + 1,
            )

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Each call dies after `deaths[k]` tokens (None: lives), in call order."""

    def __init__(self, deaths: list[int | None], error: BaseException | None = None) -> None:
        self.deaths = list(deaths)
        self.error = error or ActorDiedError("The actor died unexpectedly before finishing this task.")
        self.calls: list[FakeCall] = []
        outer = self

        class _Generate:
            def remote(self, request: GenerateRequest) -> FakeCall:
                die = outer.deaths.pop(0) if outer.deaths else None
                call = FakeCall(request, die, outer.error)
                outer.calls.append(call)
                return call

        self.generate = _Generate()


PROMPT = [3, 4, 5, 6]


def greedy(max_tokens: int) -> list[int]:
    context = list(PROMPT)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(PROMPT) :]


async def run_stream(handle: FakeHandle, max_tokens: int, max_migrations: int = 2) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    inputs = [EngineInput(index=0, prompt_index=0, prompt_token_ids=list(PROMPT), params=params)]
    limiter = InFlightLimiter(4)
    stream = GenerationStream(
        handle, inputs, "cmpl-test", JointPermit(limiter.acquire(1), None), 30.0, IngressMetrics("m"), max_migrations=max_migrations
    )
    await stream.start()
    outs = [event.output async for event in stream]
    assert limiter.in_flight == 0
    return outs


@pytest.mark.parametrize("deaths", [[5], [0], [3, 4], [1, 0]])
async def test_migrated_stream_is_identical_to_an_undisturbed_one(deaths: list[int]) -> None:
    handle = FakeHandle(deaths)
    outs = await run_stream(handle, 12)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == greedy(12)
    assert len(handle.calls) == len(deaths) + 1
    last = outs[-1]
    assert last.finished and last.finish_reason == "length"
    # Counts as the client's request sees them, not the resumed request's.
    assert last.num_prompt_tokens == len(PROMPT) and last.num_output_tokens == 12
    # The resumed request: prompt + generated, max_tokens reduced, replayed tokens marked.
    generated = 0
    for call, died in zip(handle.calls, deaths + [None]):
        assert call.request.num_resumed_tokens == generated
        assert call.request.prompt_token_ids == PROMPT + greedy(12)[:generated]
        assert call.request.params.max_tokens == 12 - generated
        generated += died or 0
    assert len({c.request.request_id for c in handle.calls}) == len(handle.calls)


async def test_beyond_the_migration_limit_the_stream_fails_with_503() -> None:
    handle = FakeHandle([2, 2, 2])
    params = SamplingParams(max_tokens=12, temperature=0.0)
    inputs = [EngineInput(index=0, prompt_index=0, prompt_token_ids=list(PROMPT), params=params)]
    stream = GenerationStream(handle, inputs, "cmpl-x", JointPermit(InFlightLimiter(4).acquire(1), None), 30.0, IngressMetrics("m"), max_migrations=2)
    await stream.start()
    tokens: list[int] = []
    with pytest.raises(errors.APIError) as info:
        async for event in stream:
            tokens += event.output.new_token_ids
    assert info.value.status == 503
    assert tokens == greedy(12)[:6]
    assert len(handle.calls) == 3


async def test_migration_disabled_and_request_errors_are_not_migrated() -> None:
    handle = FakeHandle([0])
    with pytest.raises(errors.APIError) as info:
        await run_stream(handle, 5, max_migrations=0)
    assert info.value.status == 503 and len(handle.calls) == 1

    handle = FakeHandle([2], error=ValueError("bad request"))
    params = SamplingParams(max_tokens=5, temperature=0.0)
    inputs = [EngineInput(index=0, prompt_index=0, prompt_token_ids=list(PROMPT), params=params)]
    stream = GenerationStream(handle, inputs, "cmpl-y", JointPermit(InFlightLimiter(4).acquire(1), None), 30.0, IngressMetrics("m"))
    await stream.start()
    with pytest.raises(errors.APIError) as info:
        async for _ in stream:
            pass
    assert info.value.status == 500 and len(handle.calls) == 1


def test_replica_failures_are_recognised() -> None:
    assert is_replica_failure(ActorDiedError("x"))
    assert is_replica_failure(RayTaskError(ReplicaDrainingError("draining")))
    assert not is_replica_failure(RayTaskError(ValueError("x")))
    assert not is_replica_failure(ValueError("x"))
    assert api_error_of(ActorDiedError("x")).status == 503
    migration = Migration(GenerateRequest("r", [1, 2], SamplingParams(max_tokens=3, min_tokens=2)), 5)
    for t in (7, 8, 9):
        migration.observe(RequestOutput("r", [t]))
    assert migration.next_request(ActorDiedError("x")) is None  # all tokens were generated


def test_real_ray_error_types_are_recognised() -> None:
    from ray import exceptions
    import ray.serve.exceptions as serve_exceptions
    assert is_replica_failure(exceptions.ActorDiedError())
    assert is_replica_failure(exceptions.ActorUnavailableError("unavailable", None))
    assert is_replica_failure(exceptions.RayActorError())
    assert is_replica_failure(serve_exceptions.ReplicaUnavailableError("replica-1"))
    assert not is_replica_failure(serve_exceptions.BackPressureError(num_queued_requests=1, max_queued_requests=1))


def test_lost_kv_source_is_a_replica_failure_a_bad_export_is_not() -> None:
    """Disaggregation: the prefill replica that held a request's KV died before the decode
    replica fetched it -> resume (recompute on the decode pool); a layout mismatch -> fail."""
    from kv.transfer import KVSourceLostError, KVTransferError

    assert is_replica_failure(RayTaskError(KVSourceLostError("lost with its prefill replica")))
    assert not is_replica_failure(RayTaskError(KVTransferError("block_size: export has 8, this cache has 16")))
    migration = Migration(GenerateRequest("r", [1, 2], SamplingParams(max_tokens=4)), 2)
    migration.observe(RequestOutput("r", [7]))  # the prefill replica's first token
    resumed = migration.next_request(RayTaskError(KVSourceLostError("lost")))
    assert resumed is not None and resumed.prompt_token_ids == [1, 2, 7] and resumed.num_resumed_tokens == 1


# -- the worker side: text continues seamlessly --------------------------------------------
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Streaming text with emoji 😀🎉👍🏽 and families 👨‍👩‍👧 is fun.",
    "中文分词测试，你好世界。日本語のテキストも。",
    "STOP here. The end is near: ###END### and more text after.",
] * 3


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def deltas(processor: RequestOutputProcessor, ids: list[int], finish: bool) -> tuple[str, bool]:
    text = ""
    for i, t in enumerate(ids):
        last = finish and i == len(ids) - 1
        out = processor.process(RequestOutput("r", [t], finished=last, finish_reason="length" if last else None))
        text += out.text_delta
        if processor.stopped:
            return text, True
    return text, False


@pytest.mark.parametrize("stop", [(), ("###END###",), ("near: #",)])
def test_detokenizer_replay_continues_the_text_exactly(tokenizer: Any, stop: tuple[str, ...]) -> None:
    prompt = tokenizer.encode("Tell me: ")
    output = tokenizer.encode("emoji 😀🎉👍🏽 中文分词 The end is near: ###END### and more")
    params = SamplingParams(max_tokens=len(output), stop=stop)
    undisturbed, _ = deltas(RequestOutputProcessor(tokenizer, prompt, params), output, finish=True)
    for cut in range(1, len(output)):
        first, stopped = deltas(RequestOutputProcessor(tokenizer, prompt, params), output[:cut], finish=False)
        if stopped:  # the stop string ended it before the cut: nothing to migrate
            assert first == undisturbed
            continue
        resumed = RequestOutputProcessor(tokenizer, prompt + output[:cut], params, num_resumed_tokens=cut)
        rest, _ = deltas(resumed, output[cut:], finish=True)
        assert first + rest == undisturbed, cut


async def test_grpc_stream_beyond_the_migration_limit_is_unavailable() -> None:
    import grpc
    from tests.unit.router.frontend.grpc_api.test_grpc_servicer import FakeContext, FakeIngress, request

    ingress = FakeIngress()
    ingress.worker.fail = ActorDiedError("The actor died unexpectedly before finishing this task.")
    context = FakeContext()
    await ingress.Generate(request(), grpc_context=context)
    assert context.code() == grpc.StatusCode.UNAVAILABLE
    assert len(ingress.worker.calls) == 1 + ingress.settings.max_migrations  # retried, then given up
    assert ingress.limiter.in_flight == 0


async def test_draining_limiter_refuses_with_503() -> None:
    limiter = InFlightLimiter(4)
    permit = limiter.acquire(1)
    limiter.draining = True
    with pytest.raises(errors.APIError) as info:
        limiter.acquire(1)
    assert info.value.status == 503
    permit.release()
    assert limiter.in_flight == 0
