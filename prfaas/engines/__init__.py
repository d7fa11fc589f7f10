"""Engines and engine clients: reference CPU engine, SGLang plugin, KV transport, simulation."""
