"""The library behind `kvserve bench serve` (cluster/bench_serve.py), importable without
the CLI (benchmarks/ reuse it):

- workload.py: seeded synthetic prompts (BenchRequest, generate_workload) and Poisson
  arrival times;
- stream.py: one streamed request and its timings (RequestResult, send_request);
- client.py: the HTTP client (aiohttp; make_client) and how its failures are named;
- run.py: a whole run over one client (run_benchmark, BenchResult);
- probe.py: what is asked of the server first (fetch_models, calibrate_prompt_tokens);
- report.py: percentiles, summarize and the text table (format_summary).

    requests = generate_workload("random", num_prompts=100, input_len=256, output_len=64, seed=0)
    result = await run_benchmark(requests, base_url="http://127.0.0.1:8000", model="kvserve-tiny",
                                 request_rate=8.0, seed=0)
    summary = summarize(result.requests, result.duration_s, slo_ttft_ms=500, slo_tpot_ms=50)
    print(format_summary(summary))
"""
