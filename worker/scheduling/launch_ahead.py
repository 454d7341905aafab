"""Step N+1 on the device before step N's tokens are back (vLLM v1's async scheduling,
SGLang's overlap scheduler), in the steady state where its plan is known without them.

The overlapped loop (worker/scheduling/step_overlap.py) hides everything but update N and schedule
N+1: the device idles while they run. When the plan for N+1 was made ahead (every running
sequence decodes one token, worker/scheduling/decode_ahead.py) and the runner can take a row's input
token from the previous step's output on the device (`launches_ahead`), step N+1 is
launched before waiting for N, and nothing is left on the critical path:

    host    | launch N+1 | wait N | update N, advance N+1, outputs N, inbox, plan N+2, launch N+2 | wait N+1 |
    device  |=========== N ======|=========== N+1 (queued behind N) ===========================|== N+2 ==

    a row of plan N+1:  token_ids [ ... L-1 ]  + pending token L (N's sample, on the device)
                        num_computed_tokens = L  (advance N),  computes position L, samples L+1

The rules, and why:
- Only the steady state: nothing waits, loads, compiles or exports, and no sequence has a
  grammar (its mask for N+1 needs the matcher past token N). Anything else falls back to
  the overlapped step, whose full schedule runs with no step in flight.
- A sequence whose pending token is its last by length (max_tokens, the model's length)
  is left out: that stop is known before the token is. One that stops on EOS or a stop
  token at N is in N+1 anyway; update N+1 drops its token (it is no longer running).
- advance N+1 runs after update N, not at launch: it hashes the blocks N+1 fills from
  token_ids, which holds token N only then. A sequence that stopped is not advanced.
- Blocks freed by update N (a stop, an abort) while N+1 still writes them may go to plan
  N+2 before wait N+1. That is safe because the device runs steps in launch order (one
  stream): N+2's writes land after N+1's. Blocks evicted from the prefix cache for N+1's
  tables go down to the host tier before the launch, as a schedule's do.
- Greedy outputs are the same tokens: every row computes what the serial step computes,
  from the same token, at the same position.
"""
from __future__ import annotations

from worker.scheduling.plan import SchedulerOutput
from worker.sequence import Sequence


def last_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Will the token `seq` is about to get (one past its token_ids) end it by length?
    The length half of worker/scheduling/stop_check.py, one token early."""
    num_tokens = len(seq.token_ids) + 1
    return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= max_model_len


def launch_plan(seqs: list[Sequence], block_ids: list[list[int]], max_model_len: int) -> SchedulerOutput | None:
    """The plan to launch ahead from a decode-ahead plan's rows (each table already holds
    the pending token); None when no row would outlive its pending token, or when a row
    has a grammar."""
    out = SchedulerOutput(pending_inputs=True)
    for seq, table in zip(seqs, block_ids):
        if seq.grammar is not None:
            return None
        if last_by_length(seq, max_model_len):
            continue
        out.seqs.append(seq)
        out.block_ids.append(table)
    if not out.seqs:
        return None
    out.num_new_tokens = [1] * len(out.seqs)
    return out
