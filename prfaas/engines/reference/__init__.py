"""The reference engine (on the CPU or a GPU): real hybrid models from `transformers`, the
hybrid prefix cache pool (`block_pool`), prefill/decode roles, SGLang-compatible HTTP API and
KV events.

Sub-packages, one job each: `model/` (presets, forward passes, the model-facing cache),
`cache/` (the hybrid prefix cache pool and its tensors), `step/` (the engine step),
`handoff/` (prefill -> decode KV hand-off, in-process or over `engines/transport`),
`server/` (HTTP: SGLang `/generate`, OpenAI routes, admin; `prfaas engine`).
"""
