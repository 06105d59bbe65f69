"""Runners execute one model step on one backend; they own bucketing, padding and the KV tensors."""
