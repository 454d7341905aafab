"""Every seeded workload kvserve's tools send, one module per kind of request; the same
arguments (seed included) give the same requests, token for token.

- token_prompts: token-id prompts for side-by-side engine benchmarks (greedy, EOS ignored,
  so every system produces the same tokens).
- text_prompts: prompts of random words for `kvserve bench serve` and the HTTP load clients
  of benchmarks/ (random or shared-prefix), lengths calibrated to the server's tokenizer.
- disagg: the decode streams and long prompts of `python -m benchmarks.disagg`.
- sim_kinds: the simulator's named workloads (sharegpt, b2b, agentic, code, bursty, trace,
  lora) as token ids the KV manager hashes, with their arrival times.
- draws: the length and arrival distributions they share.
"""
