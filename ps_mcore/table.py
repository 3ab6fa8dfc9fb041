"""One table format for the CLI, the demo and the benchmarks: aligned markdown."""

from __future__ import annotations


def format_cell(x: object) -> str:
    """One value as the tables show it (3 significant digits, "-" for NaN)."""
    if isinstance(x, float):
        if x != x:
            return "-"
        if x == 0 or 1e-3 <= abs(x) < 100:
            return f"{x:.3g}"
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1e}"
    return str(x)


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """Rows under headers, right-aligned columns, valid markdown (pastes into docs)."""
    cells = [[format_cell(x) for x in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(r):
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in cells])
