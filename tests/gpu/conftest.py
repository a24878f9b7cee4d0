"""GPU checks: ``python -m pytest tests/gpu -q`` on a machine with one CUDA device (a few minutes); skipped without."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped cleanly without one")
