"""Request migration: resume an engine request on another replica when its replica dies.

The ingress keeps, per engine request, the token ids already streamed to the client. When
the worker stream fails because the replica is gone (not because the request was bad),
the request is sent again as

    prompt' = prompt + generated          (the new replica recomputes their KV, or finds
                                           the prompt's blocks in its prefix cache)
    max_tokens' = max_tokens - len(generated), min_tokens likewise, prompt_logprobs off
                  (the client has them), other params the same
    num_resumed_tokens = len(generated)   (the worker replays them through a fresh
                                           detokenizer, so text deltas and stop strings
                                           continue exactly where the dead one stopped,
                                           and through a structured-output grammar, so
                                           the output stays valid under it)

and its outputs are re-based (prompt/output counts as the client's request sees them), so
the client sees one continuous stream. Greedy output is token-identical to an undisturbed
run. Limits: a seeded sampler restarts its generator on the new replica, so seeded
sampled output after a migration differs from an undisturbed seeded run (it is still a
valid sample); presence/frequency penalties only count the tokens generated after the
migration (the earlier ones are prompt tokens there). A request with no token yet is simply
sent again unchanged. At most `max_migrations` times per engine request (0: off); then
the stream fails with 503 (gRPC UNAVAILABLE).

Which errors mean "the replica is gone" (Ray 2.60, ray/exceptions.py and
ray/serve/exceptions.py): RayActorError and its subclasses ActorDiedError (the actor was
killed or its process died) and ActorUnavailableError (unreachable, maybe restarting);
WorkerCrashedError; Serve's ReplicaUnavailableError (the chosen replica is no longer
available); a RayTaskError whose cause is one of these; and the worker's own
ReplicaDrainingError (a replica being removed refuses new streams) and EngineDeadError
(its step loop has stopped); and kv/transfer.py's KVSourceLostError (disaggregation: the
prefill replica that held the request's KV died before the decode replica fetched it; the
request resumes on the decode pool, recomputing its prompt there).
"""
from __future__ import annotations

from dataclasses import replace

from worker.api import GenerateRequest, RequestOutput

# Matched by name, so that this module (and its unit tests) need not import Ray.
REPLICA_FAILURE_ERRORS = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "WorkerCrashedError",
        "ReplicaUnavailableError",
        "ReplicaDrainingError",
        "EngineDeadError",
        "KVSourceLostError",  # kv/transfer.py: the prefill replica holding the KV died
    }
)


def is_replica_failure(error: BaseException) -> bool:
    """True when `error` says the replica (not the request) failed."""
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 4:
        # RayTaskError is re-created as a subclass of its cause's class: check the MRO.
        if any(cls.__name__ in REPLICA_FAILURE_ERRORS for cls in type(current).__mro__):
            return True
        current = getattr(current, "cause", None)
        seen += 1
    return False


class Migration:
    """One engine request's progress, and how to resume it elsewhere."""

    def __init__(self, request: GenerateRequest, max_migrations: int) -> None:
        self.original = request
        self.request = request  # what is (or was last) sent
        self.max_migrations = max_migrations
        self.num_migrations = 0
        self.generated_token_ids: list[int] = []
        self._num_resumed = 0  # tokens of self.request's prompt that are earlier output

    def observe(self, out: RequestOutput) -> RequestOutput:
        """Record an output of the current attempt and re-base it onto the original request."""
        self.generated_token_ids.extend(out.new_token_ids)
        if self._num_resumed:
            out.num_prompt_tokens -= self._num_resumed
            out.num_output_tokens += self._num_resumed
            out.num_cached_tokens = min(out.num_cached_tokens, out.num_prompt_tokens)
        return out

    def next_request(self, error: BaseException) -> GenerateRequest | None:
        """The request to send after `error`, or None when it must fail the stream."""
        if not is_replica_failure(error) or self.num_migrations >= self.max_migrations:
            return None
        params = self.original.params
        k = len(self.generated_token_ids)
        if k >= params.max_tokens:  # everything was generated; only the final output was lost
            return None
        self.num_migrations += 1
        self._num_resumed = k
        # The client has the prompt logprobs already (the first output carried them): the
        # resumed request asks none, or the earlier output would come back as prompt entries.
        new_params = replace(params, max_tokens=params.max_tokens - k, min_tokens=max(0, params.min_tokens - k),
                             prompt_logprobs=None) if k else params
        self.request = replace(
            self.original,
            request_id=f"{self.original.request_id}-m{self.num_migrations}",
            prompt_token_ids=list(self.original.prompt_token_ids) + self.generated_token_ids,
            params=new_params,
            num_resumed_tokens=k,
        )
        return self.request
