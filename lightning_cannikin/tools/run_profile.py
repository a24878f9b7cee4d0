"""The run profile's JSON format, kept importable from here for ``tools`` and older scripts.

The format lives in :mod:`lightning_cannikin.core.profile`, where the training side reads it without importing
``tools/``.
"""

from __future__ import annotations

from lightning_cannikin.core.profile import (
    FORMAT,
    PROFILE_FILENAME,
    VERSION,
    DeviceProfile,
    Profile,
    build_profile,
    load_profile,
    save_profile,
)

__all__ = [
    "FORMAT",
    "PROFILE_FILENAME",
    "VERSION",
    "DeviceProfile",
    "Profile",
    "build_profile",
    "load_profile",
    "save_profile",
]
