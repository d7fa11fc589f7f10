"""Pure decisions: deployment profiles, the throughput model, the planner, routing policies."""
