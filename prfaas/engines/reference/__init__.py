"""CPU reference engine: real hybrid models from `transformers`, the hybrid prefix cache pool
(`block_pool`), prefill/decode roles, SGLang-compatible HTTP API and KV events.

Module map (one job each):

- model: `presets` (tiny seeded hybrid models, local checkpoints), `runner` (forward passes
  with per-layer hooks), `hybrid_cache` (engine-owned KV + linear state, batched);
- cache: `block_pool`, `prefix_index`, `state_slots`, `pool_types`, `pool_integrity` (the pure
  pool), `storage` (the tensors beside it);
- engine: `core` (the step: admit, prefill, batched decode), `prefill` (block-aligned pieces,
  layer shipping), `request`, `sampling`, `stopping`, `metrics`, `config`;
- hand-off: `handoff` (interface, in-process), `transport_handoff` (over the TCP transport);
- serving: `service` (async face, worker thread), `server` + `openai_api` + `protocol` +
  `streaming` + `http_errors` + `app_keys` (HTTP), `tokenizers`, `launch` (`prfaas engine`).
"""
