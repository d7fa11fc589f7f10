"""PrfaaS: Prefill-as-a-Service for hybrid-attention LLMs."""

__version__ = "0.1.0"
