"""Workloads, the streaming benchmark client, reports, and the virtual-clock runner."""
