"""The `prfaas` command line: one module per subcommand."""
