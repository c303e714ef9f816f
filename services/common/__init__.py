"""Shared plumbing for llmq's services: settings, Kafka client factories, telemetry.

Nothing here makes a scheduling decision; the pure core lives in ``*/core`` packages.
"""
