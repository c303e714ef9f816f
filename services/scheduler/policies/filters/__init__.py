"""Hard constraints on placement, one module per filter (see each module's docstring)."""
