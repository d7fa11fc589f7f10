"""The engine step: admit, chunked block-aligned prefill, continuous-batching decode, sampling,
stopping, counters."""
