"""CPU reference engine: real hybrid models from `transformers`, the hybrid prefix cache pool
(`block_pool`), prefill/decode roles, SGLang-compatible HTTP API and KV events."""
