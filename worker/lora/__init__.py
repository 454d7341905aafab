"""Multi-LoRA serving: PEFT adapters applied per row of the flat token batch.

Torch-free here and in slots.py / registry.py / engine_lora.py (the scheduler and engine
import them); adapter.py, layers.py and model_lora.py are the runner's (torch).
"""
