"""Run Python code in an interpreter where some installed distributions are absent, as if never installed.

The child process starts without the ``site`` module (``-S``) and sees, instead of the real site-packages, a folder
of links to every entry of it except the named distributions' modules and metadata. Both ``import rich`` and
``importlib.metadata.version("rich")`` then fail, as they do where rich is not installed (Lightning decides on its
rich progress bar from the metadata, so blocking the import alone would not do).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _top_name(entry: str) -> str:
    """``rich`` for ``rich``, ``rich-15.0.0.dist-info``, ``rich.libs`` or ``rich.py``."""
    return re.split(r"[-.]", entry, maxsplit=1)[0].lower().replace("_", "-")


def run_without(missing: set[str], args: list[str], folder: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -S ARGS`` with the worktree first on the path and the ``missing`` distributions hidden.

    Args:
        missing: top-level names to hide (``{"rich"}``, ``{"matplotlib", "mpl-toolkits", "pylab"}``).
        args: the interpreter's arguments after ``-S`` (``["-c", code]``, ``["-m", module, ...]``).
        folder: an empty folder for the links; also the child's working directory.
        timeout: seconds before the child is killed.

    """
    site = folder / "site-packages"
    site.mkdir()
    for source in (Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()):
        for entry in source.iterdir():
            target = site / entry.name
            if _top_name(entry.name) not in missing and not target.exists():
                target.symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    return subprocess.run(
        [sys.executable, "-S", *args], capture_output=True, text=True, timeout=timeout, cwd=folder, env=env, check=False
    )
