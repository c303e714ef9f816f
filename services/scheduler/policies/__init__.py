"""Placement policies: filters, scorers and pickers, a registry, and profiles.

Owns the plugin Protocols (:mod:`.base`), one module per policy (``filters/``,
``scorers/``, ``pickers/``), the name → factory :data:`~.registry.REGISTRY` and the profile
that assembles them into a :class:`~.profile.Pipeline` (:mod:`.profile`). Plugins are
stateless and pure; the scheduling cycle (:mod:`services.scheduler.core.cycle`) is their
only caller.
"""
