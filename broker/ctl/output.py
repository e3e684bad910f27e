"""How ``skredctl`` prints: one path for every list (table or JSON), objects as ``key: value``
lines, and a one-line confirmation for changes."""

from __future__ import annotations

import json
from typing import Any, TextIO


def cell(item: Any, col: str) -> str:
    """The text of column ``col`` of a row; ``a.b`` reaches into nested objects."""
    for part in col.split("."):
        item = item.get(part) if isinstance(item, dict) else None
    if isinstance(item, list):
        return ",".join(str(x) for x in item)
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, dict):
        return json.dumps(item, sort_keys=True)
    return "" if item is None else str(item)


def table(rows: list[dict[str, Any]], columns: list[str], header: bool = True) -> str:
    cells = [[cell(r, c) for c in columns] for r in rows]
    widths = [max([len(c) if header else 0] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()] if header else []
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def pick(row: dict[str, Any], columns: list[str]) -> dict[str, Any]:
    """The row cut to ``columns`` (nested ``a.b`` columns keep their dotted name)."""
    out: dict[str, Any] = {}
    for col in columns:
        value: Any = row
        for part in col.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[col] = value
    return out


class Out:
    """The chosen format (``text`` or ``json``) and ``--silent`` (no table header)."""

    def __init__(self, stream: TextIO, fmt: str = "text", silent: bool = False) -> None:
        self.stream = stream
        self.json = fmt == "json"
        self.silent = silent

    def write(self, text: str) -> None:
        print(text, file=self.stream)

    def rows(self, rows: list[dict[str, Any]], columns: list[str] | None) -> None:
        """A list: the full API rows as JSON unless columns were asked for; else a table."""
        if self.json:
            self.write(json.dumps(rows if columns is None else [pick(r, columns) for r in rows], indent=2))
            return
        cols = columns or (sorted({k for r in rows for k in r}) if rows else ["name"])
        self.write(table(rows, cols, header=not self.silent))

    def obj(self, value: Any, text: str | None = None) -> None:
        if self.json:
            self.write(json.dumps(value, indent=2))
        elif text is not None:
            self.write(text)
        elif isinstance(value, dict):
            self.write("\n".join(f"{k}: {cell(value, k) if '.' not in k else value[k]}" for k in value))
        else:
            self.write(str(value))

    def done(self, message: str) -> None:
        self.write(json.dumps({"ok": True, "message": message}) if self.json else message)
