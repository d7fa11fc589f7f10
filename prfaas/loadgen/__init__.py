"""Workloads, arrivals, the streaming benchmark client, statistics, reports and plots."""
