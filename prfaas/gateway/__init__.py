"""The request path (Router: hash, KV index, policy, dispatch, relay), instances, health,
admission, link telemetry; `api/` is its HTTP face."""
