"""Discrete-event simulator of an llmq fleet (bench): drives the same pure core as the
live services over many ``sim`` engines.

``workload`` loads real traces (Azure LLM 2023, Mooncake JSONL), generates synthetic
ones, attaches tenants and priorities, and scales arrivals to a target offered load.
The simulator driver and the bench CLI are the callers.
"""
