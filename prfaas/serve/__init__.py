"""`prfaas serve`: the deployment file, the embedded default, launched engine processes,
start-up profiling and the summary."""
