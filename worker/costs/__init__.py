"""The step-cost model: how long an engine step takes on a device, from its plan. The
engine prices its own steps with it (the step-time budget), the simulated device waits
it out (worker/sim), and `kvserve calibrate` fits it.

    shapes.py      ModelShape from a config.json (named: llama-3-8b, llama-3-70b, qwen3-32b)
    profiles.py    DeviceProfile: h200, h100, a100-80gb, l4, or a fitted JSON (profiles/*.json)
    cost_model.py  StepCostModel: a plan's step time and the KV blocks a device holds
    fit.py         fitting a profile's efficiencies and overheads to measured steps
"""
