"""Soft preferences in [0, 1], one module per scorer (see each module's docstring)."""
