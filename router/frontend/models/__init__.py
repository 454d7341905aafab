"""Many models behind one ingress: each model's pools and pipeline, and the directory that
picks a request's model (by its `model`, and the caller's key)."""
