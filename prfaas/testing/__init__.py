"""Doubles a user may run: the null server (not an engine) for overhead measurements; a
throwaway certificate authority (`tls_certs`) for trying transport TLS; a single-member etcd
(`etcd_server`) for trying gateway replicas."""
