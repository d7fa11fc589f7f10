"""The hybrid prefix cache pool (a pure data structure: blocks, prefix index, state slots,
integrity checks) and the tensors beside it."""
