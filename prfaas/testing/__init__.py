"""Doubles a user may run: the null server (not an engine) for overhead measurements."""
