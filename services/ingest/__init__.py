"""Ingest: the front door of llmq.

Owns API keys → tenant, request validation, token counting, per-tenant rate limits,
cluster-saturation rejections and lane classification (DESIGN.md, "Services"). Every
decision lives in :mod:`services.ingest.core` (pure); the HTTP API and the Faust agents
around it only build inputs, call the core and publish its decisions.
"""
