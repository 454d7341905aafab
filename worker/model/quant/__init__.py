"""Quantized checkpoints: what a `quantization_config` asks for (spec.py, torch-free), and
a reader that presents the files' quantized tensors as the dequantized Hugging Face weights
the loader copies into the model (checkpoint.py), one module per published format."""
