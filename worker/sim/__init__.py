"""The simulated device: the engine's device seam, modelled instead of run. Its step
times come from the step-cost model (worker/costs).

    runner.py      SimRunner (the engine's runner: modelled time, deterministic tokens)
    build.py       build_sim_engine, and build_engine's branch for `device: sim:<profile>`
    device.py      the `sim:<profile>` device string

Without Ray (the discrete-event simulator, tests): the real Engine on a SimRunner that
does not sleep; after each `engine.step()`, `engine.runner.last_step_s` is the modelled
duration of that step for a virtual clock:

    from worker.config import CacheConfig, SchedulerConfig
    from worker.sim.build import build_sim_engine
    engine = build_sim_engine("llama-3-8b", "h200", SchedulerConfig(max_num_seqs=256,
                              max_num_batched_tokens=8192, max_model_len=8192), CacheConfig())
    # KV blocks: CacheConfig.num_blocks_override, else device memory x gpu_memory_utilization
    # minus the weights (52,852 blocks of 16 for llama-3-8b on an H200).

In a Serve cluster: `engine.device: sim:h200` (+ `engine.model_shape`, `engine.time_dilation`)
and build_engine builds the same thing with sleep=True. To price plans without an
engine: StepCostModel(shape, profile).plan_time_s(plan) or .step_time_s([SeqWork(...)]).
"""
