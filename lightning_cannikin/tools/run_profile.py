"""The run profile's JSON format, kept importable from here for ``tools`` and older scripts.

The format lives in :mod:`lightning_cannikin.core.profile`, where the training side reads it without importing
``tools/``.
"""

from __future__ import annotations

from lightning_cannikin.core import profile as _profile
from lightning_cannikin.core.profile import *  # noqa: F403  (the same names, one definition)

__all__ = _profile.__all__
