"""The simulated device: a step-cost model (roofline per component + overheads) over a
model shape (config.json only) and a device profile (spec sheet or fitted), and a runner
that the real engine drives in place of the model runner (worker/sim/runner.py)."""
