"""The model runner: executes a plan as one flat token batch on the device.

    model_runner.py    ModelRunner: flat inputs, forward, logits, sampling
    batches.py         a step's host inputs and a launched step
    protocols.py       what the engine needs of a runner (real, simulated or TP rank 0)
    decode_groups.py   how the grouped attention backend batches decodes (torch-free)
    cuda_graphs.py     CUDA graphs for decode-only steps
    forward_timer.py   time in the forward (CUDA events or wall clock)
    memory_profile.py  the activation peak, for KV sizing on GPU
"""
