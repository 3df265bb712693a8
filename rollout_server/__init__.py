"""Inference tier: a JetStream-shaped engine that returns exact token ids and log-probs."""
