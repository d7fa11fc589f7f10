"""PrfaaS in vLLM: a KV connector (`connector.PrfaasConnector`, `SupportsHMA`) that streams a
hybrid model's KV layer by layer over the PrfaaS transport, a thin adapter over
`prfaas.engines.kv_pages`. Runs inside vLLM (its own environment); nothing here is imported
by the gateway. The exchange with the gateway is in `PROTOCOL.md`.
"""
