"""Speculative decoding: draft tokens proposed for decode rows (the n-gram proposer),
planned with their lookahead KV blocks, verified by the target in the same step (greedy
agreement or rejection sampling) and applied to their sequences. docs/architecture.md
("Speculative decoding") draws the flow."""
