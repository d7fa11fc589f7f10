"""The model: tiny seeded hybrid presets and local checkpoints, forward passes over
engine-owned state with per-layer hooks."""
