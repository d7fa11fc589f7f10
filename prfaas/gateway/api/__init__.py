"""The gateway's HTTP face: routes, the OpenAI completion service, Prometheus metrics."""
