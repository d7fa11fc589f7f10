"""Doubles a user may run: the null server (not an engine) for overhead measurements; a
throwaway certificate authority (`tls_certs`) for trying transport TLS."""
