"""Choosing one candidate, one module per picker (see each module's docstring).

``max-score`` is llmq's; ``round-robin``, ``least-requests`` and ``random`` are baselines
for the simulator: they ignore scores but still only see workers that passed every filter.
"""
