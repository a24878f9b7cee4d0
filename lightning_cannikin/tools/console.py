"""Console output of the ``cannikin`` commands: rich tables when rich is installed, plain aligned text otherwise.

rich is optional (the ``cli`` extra): installed, Lightning switches its own progress bar and model summary to rich
ones, which installing this package must not do. The commands print the same cells either way, so what a script greps
does not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["print_line", "print_table"]


def _rich_console() -> Any | None:
    """A rich ``Console`` without highlighting, or ``None`` when rich cannot be imported."""
    try:
        import rich  # noqa: F401  (the top-level import fails first when rich is absent or blocked)
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False)


def print_table(title: str, columns: Sequence[tuple[str, bool]], rows: Sequence[Sequence[str]]) -> None:
    """Print a table.

    Args:
        title: printed above the table, left-aligned.
        columns: ``(header, right_aligned)`` per column.
        rows: the cells, already formatted, one sequence per row.

    """
    console = _rich_console()
    if console is not None:
        from rich.box import SIMPLE_HEAD
        from rich.table import Table

        # a rule under the header and no frame: two columns' width more for the cells at 80 columns
        table = Table(title=title, title_justify="left", box=SIMPLE_HEAD, pad_edge=False)
        for header, right in columns:
            table.add_column(header, justify="right" if right else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, (header, _) in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, (_, right) in zip(cells, widths, columns, strict=True)
        ).rstrip()

    print(title)
    print(line([header for header, _ in columns]))
    print(line(["-" * width for width in widths]))
    for row in rows:
        print(line(row))
    print()


def print_line(text: str) -> None:
    """Print one line as is (no markup), unwrapped at any terminal width so scripts can grep it."""
    console = _rich_console()
    if console is None:
        print(text)
    else:
        console.print(text, markup=False, soft_wrap=True)
