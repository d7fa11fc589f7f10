"""The simulator: the real Router on a virtual clock against SIMULATED engines, links and
caches at the paper's scale (its model and results: SIMULATION.md)."""
