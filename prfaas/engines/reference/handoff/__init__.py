"""The prefill -> decode KV hand-off: the interface with an in-process implementation, and
one over the cross-DC transport."""
