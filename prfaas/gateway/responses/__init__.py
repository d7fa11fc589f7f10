"""OpenAI Responses state: stored responses and their conversations, kept by the gateway."""
