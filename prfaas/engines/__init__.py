"""Everything that runs a model, behind one engine-client interface (`client.py`): the SGLang
client, the CPU reference engine, the cross-DC KV transport."""
