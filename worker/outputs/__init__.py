"""Outputs: from the engine's token-level results to what a client sees.

    request_output.py  one RequestOutput from a sequence's state
    detokenizer.py     incremental text and stop strings
    processor.py       OutputProcessor: text deltas, stop strings, final outputs
    sink.py            where a request's outputs go on the event loop
    streams.py         batched output streams: once per step per ingress
"""
