"""Every wire schema, defined once and used by both ends: OpenAI request and response bodies,
SGLang's `/generate` (sampling parameters, request, answer), the OpenAI error body, KV events."""
