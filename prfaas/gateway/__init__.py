"""HTTP front door and the request path (OpenAI API, KV index, dispatch)."""
