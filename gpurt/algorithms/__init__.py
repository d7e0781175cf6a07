"""Collective algorithms as pure functions returning schedules (see ``base``)."""

from __future__ import annotations

# registration happens at import
from . import base, direct, exchange, recursive, ring, tree  # noqa: F401
from .base import ALIASES, REGISTRY, Algorithm, Cost, lookup, register

__all__ = ["ALIASES", "REGISTRY", "Algorithm", "Cost", "lookup", "register"]
