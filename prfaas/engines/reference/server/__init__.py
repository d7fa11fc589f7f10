"""Serving: the async face of the engine (worker thread), SGLang's `/generate`, the OpenAI
routes, admin routes, errors, and `prfaas engine`'s assembly."""
