"""``skredctl tui``: a terminal dashboard over the management API (stdlib ``curses``).

Theory of operation: one loop, no threads. Each turn it polls the page on screen (one GET),
draws it, then waits for a key for at most the poll interval. The interval adapts so the
dashboard costs the broker at most a tenth of its time for our requests: after a request
that took ``t`` seconds the next one waits at least ``10 * t`` (and never less than
``--interval``). The overview keeps the last samples of the message rates and queue depth
it has seen (seeded from the broker's own history where the overview answers RabbitMQ's
``msg_rates_age`` query with ``samples``) and draws them as sparklines. A list page is paged
to the terminal's height, sorted by a column (``S`` cycles, ``R`` reverses), filtered by a
substring (``/``), and ``Enter`` opens the selected row's details; a resize redraws at the
new size. Keys: Tab/Right and Shift-Tab/Left or the page's letter switch pages, Up/Down/
PgUp/PgDn/Home/End move, Esc leaves details or a filter, Q (capital: q opens queues) quits.
"""

from __future__ import annotations

import argparse
import curses
import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.ctl.client import Client, CtlError
from broker.ctl.output import cell

SPARK = " ▁▂▃▄▅▆▇█"
HISTORY = 120  # samples kept for the overview's graphs
# RabbitMQ's API answers these with ``samples`` in each ``*_details``: ten minutes, every 5 s
HISTORY_QUERY = "?msg_rates_age=600&msg_rates_incr=5&lengths_age=600&lengths_incr=5"
BROKER_SHARE = 0.1  # at most this share of wall time is spent waiting on our requests


@dataclass(frozen=True)
class Page:
    key: str  # the letter that opens it
    title: str
    path: str
    columns: tuple[str, ...]


PAGES: tuple[Page, ...] = (
    Page("o", "overview", "/api/overview", ()),
    Page(
        "q",
        "queues",
        "/api/queues",
        (
            "vhost",
            "name",
            "type",
            "state",
            "messages",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
        ),
    ),
    Page("c", "connections", "/api/connections", ("name", "user", "vhost", "protocol", "channels", "state")),
    Page(
        "h",
        "channels",
        "/api/channels",
        ("name", "user", "vhost", "consumer_count", "messages_unacknowledged"),
    ),
    Page("e", "exchanges", "/api/exchanges", ("vhost", "name", "type", "durable", "auto_delete", "internal")),
    Page(
        "n",
        "consumers",
        "/api/consumers",
        ("queue.vhost", "queue.name", "consumer_tag", "ack_required", "prefetch_count"),
    ),
    Page("v", "vhosts", "/api/vhosts", ("name", "messages", "messages_ready", "messages_unacknowledged")),
    Page(
        "d", "nodes", "/api/nodes", ("name", "type", "running", "uptime", "mem_used", "fd_used", "disk_free")
    ),
    Page("p", "policies", "/api/policies", ("vhost", "name", "pattern", "apply-to", "priority")),
    Page("s", "shovels", "/api/shovels", ("vhost", "name", "type", "state")),
    Page(
        "f",
        "federation",
        "/api/federation-links",
        ("vhost", "upstream", "type", "exchange", "queue", "status"),
    ),
    Page("u", "users", "/api/users", ("name", "tags")),
    Page("l", "logs", "/api/logs", ("time", "level", "message")),
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tui",
        help="a terminal dashboard (overview graphs, paged sortable lists, details)",
        description="Keys: Tab/Shift-Tab or a page's letter ("
        + ", ".join(f"{pg.key} {pg.title}" for pg in PAGES)
        + "); Up/Down/PgUp/PgDn move; "
        "Enter details; S sort by next column; R reverse; / filter; Esc back; Q quit.",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls (at least; default 2)")


def spark(values: list[float], width: int) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    top = max(vals) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(round(v / top * (len(SPARK) - 1))))] for v in vals)


def sort_key(value: Any) -> tuple[int, float, str]:
    if isinstance(value, bool):
        return (0, float(value), "")
    if isinstance(value, int | float):
        return (0, float(value), "")
    return (1, 0.0, "" if value is None else str(value))


def _get(row: Any, col: str) -> Any:
    for part in col.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


class State:
    """What is on screen; kept apart from curses so it can be reasoned about (and tested) alone."""

    def __init__(self) -> None:
        self.page = 0
        self.rows: list[dict[str, Any]] = []
        self.error = ""
        self.sort_col = 0
        self.reverse = False
        self.filter = ""
        self.typing: str | None = None  # the filter being typed
        self.selected = 0
        self.top = 0
        self.detail: dict[str, Any] | None = None
        self.detail_top = 0
        self.position = ""  # which rows a list page shows, for the status line
        self.overview: dict[str, Any] = {}
        self.history: dict[str, deque[float]] = {
            k: deque(maxlen=HISTORY) for k in ("publish", "deliver", "ack", "messages")
        }

    @property
    def current(self) -> Page:
        return PAGES[self.page]

    def visible(self) -> list[dict[str, Any]]:
        cols = self.current.columns
        rows = [
            r
            for r in self.rows
            if not self.filter or any(self.filter.lower() in cell(r, c).lower() for c in cols)
        ]
        if cols:
            col = cols[self.sort_col % len(cols)]
            rows.sort(key=lambda r: sort_key(_get(r, col)), reverse=self.reverse)
        return rows

    def switch(self, index: int) -> None:
        self.page = index % len(PAGES)
        self.rows, self.error, self.sort_col, self.reverse = [], "", 0, False
        self.filter, self.selected, self.top, self.detail = "", 0, 0, None
        self.position = ""

    def absorb_overview(self, ov: dict[str, Any]) -> None:
        self.overview = ov
        stats = ov.get("message_stats") or {}
        for key in ("publish", "deliver", "ack"):
            details = stats.get(f"{key}_details") or {}
            samples = details.get("samples") or []
            if samples and not self.history[key]:  # the broker's history, oldest first
                for s in sorted(samples, key=lambda s: s.get("timestamp", 0))[:-1]:
                    self.history[key].append(float(s.get("sample", 0)))
            self.history[key].append(float(details.get("rate", 0.0) or 0.0))
        self.history["messages"].append(float((ov.get("queue_totals") or {}).get("messages", 0) or 0))


def next_wait(interval: float, took: float) -> float:
    """Seconds to the next poll after one that took ``took``: at least ``interval``, and long
    enough that our requests hold the broker for at most BROKER_SHARE of the time."""
    return max(interval, took / BROKER_SHARE)


def poll(client: Client, st: State) -> float:
    """Fetch the page on screen; the seconds the request took."""
    started = time.monotonic()
    try:
        if st.current.title == "overview":
            seed = "" if st.history["publish"] else HISTORY_QUERY  # the broker's history, once
            st.absorb_overview(client.request("GET", "/api/overview" + seed) or {})
        else:
            data = client.request("GET", st.current.path)
            st.rows = data if isinstance(data, list) else (data or {}).get("items", [])
        st.error = ""
    except CtlError as exc:
        st.rows = []
        st.error = (
            f"this broker does not offer {st.current.title} ({st.current.path})"
            if exc.http_status in (404, 405)
            else str(exc)
        )
    return time.monotonic() - started


def _put(win: Any, y: int, x: int, text: str, attr: int = 0) -> None:
    h, w = win.getmaxyx()
    if 0 <= y < h and x < w:
        try:
            win.addnstr(y, x, text, max(0, w - x - (1 if y == h - 1 else 0)), attr)
        except curses.error:
            pass


def draw(win: Any, st: State) -> None:
    win.erase()
    h, w = win.getmaxyx()
    tabs = " ".join(
        f"[{p.key}]{p.title}" if i != st.page else f"<{p.key}>{p.title.upper()}" for i, p in enumerate(PAGES)
    )
    _put(win, 0, 0, tabs, curses.A_BOLD)
    if st.detail is not None:
        # the page's own columns first, then every field the API gave
        lines = [f"{c}: {cell(st.detail, c)}" for c in st.current.columns]
        lines += ["", *json.dumps(st.detail, indent=2, sort_keys=True).splitlines()]
        _put(win, 1, 0, f"details: {st.current.title} (Esc back, Up/Down scroll)", curses.A_REVERSE)
        for i, line in enumerate(lines[st.detail_top : st.detail_top + h - 2]):
            _put(win, 2 + i, 0, line)
    elif st.current.title == "overview":
        _draw_overview(win, st, w)
    else:
        _draw_list(win, st, h, w)
    status = st.error or (
        "filter: " + st.typing + "_"
        if st.typing is not None
        else f"sort: {_sort_name(st)}{' desc' if st.reverse else ''}"
        f"{'  filter: ' + st.filter if st.filter else ''}  {st.position}{w}x{h}"
    )
    _put(win, h - 1, 0, status, curses.A_REVERSE if st.error else curses.A_DIM)
    win.refresh()


def _sort_name(st: State) -> str:
    cols = st.current.columns
    return cols[st.sort_col % len(cols)] if cols else "-"


def _draw_overview(win: Any, st: State, w: int) -> None:
    ov = st.overview
    totals = ov.get("object_totals") or {}
    qt = ov.get("queue_totals") or {}
    y = 2
    _put(
        win, y, 0, f"node {ov.get('node', '?')}  {ov.get('product_name', '')} {ov.get('product_version', '')}"
    )
    y += 1
    _put(
        win,
        y,
        0,
        "  ".join(
            f"{k} {totals.get(k, 0)}" for k in ("connections", "channels", "queues", "consumers", "exchanges")
        ),
    )
    y += 1
    _put(
        win,
        y,
        0,
        f"messages {qt.get('messages', 0)}  ready {qt.get('messages_ready', 0)}  "
        f"unacked {qt.get('messages_unacknowledged', 0)}",
    )
    y += 2
    graph_w = max(10, w - 24)
    for key, label in (
        ("publish", "publish/s"),
        ("deliver", "deliver/s"),
        ("ack", "ack/s"),
        ("messages", "queued msgs"),
    ):
        values = list(st.history[key])
        last = values[-1] if values else 0.0
        _put(win, y, 0, f"{label:>11} {last:>10.1f} ")
        _put(win, y, 23, spark(values, graph_w))
        y += 2


def _draw_list(win: Any, st: State, h: int, w: int) -> None:
    cols = st.current.columns
    rows = st.visible()
    body = max(1, h - 3)
    st.selected = max(0, min(st.selected, len(rows) - 1))
    if st.selected < st.top:
        st.top = st.selected
    elif st.selected >= st.top + body:
        st.top = st.selected - body + 1
    shown = rows[st.top : st.top + body]
    widths = [max([len(c)] + [len(cell(r, c)) for r in shown]) for c in cols]
    header = "  ".join(c.ljust(wd) for c, wd in zip(cols, widths, strict=True))
    st.position = f"({len(rows)} of {len(st.rows)}; rows {st.top + 1}-{st.top + len(shown)})  "
    _put(win, 1, 0, header, curses.A_UNDERLINE)
    for i, r in enumerate(shown):
        line = "  ".join(cell(r, c).ljust(wd) for c, wd in zip(cols, widths, strict=True))
        _put(win, 2 + i, 0, line, curses.A_REVERSE if st.top + i == st.selected else 0)


def handle_key(st: State, key: int, h: int) -> bool:
    """Apply one key; False to quit."""
    if st.typing is not None:
        if key in (10, 13, curses.KEY_ENTER):
            st.filter, st.typing, st.selected, st.top = st.typing, None, 0, 0
        elif key == 27:
            st.typing = None
        elif key in (curses.KEY_BACKSPACE, 127, 8):
            st.typing = st.typing[:-1]
        elif 32 <= key < 127:
            st.typing += chr(key)
        return True
    if st.detail is not None:
        if key in (27, curses.KEY_LEFT, ord("b")):
            st.detail = None
        elif key == curses.KEY_DOWN:
            st.detail_top += 1
        elif key == curses.KEY_UP:
            st.detail_top = max(0, st.detail_top - 1)
        elif key == ord("Q"):
            return False
        return True
    page_step = max(1, h - 3)
    moves = {curses.KEY_DOWN: 1, curses.KEY_UP: -1, curses.KEY_NPAGE: page_step, curses.KEY_PPAGE: -page_step}
    if key == ord("Q"):
        return False
    if key in (9, curses.KEY_RIGHT):
        st.switch(st.page + 1)
    elif key in (curses.KEY_BTAB, curses.KEY_LEFT):
        st.switch(st.page - 1)
    elif key in moves:
        st.selected += moves[key]
    elif key == curses.KEY_HOME:
        st.selected = 0
    elif key == curses.KEY_END:
        st.selected = len(st.rows)
    elif key == ord("S"):
        st.sort_col += 1
    elif key == ord("R"):
        st.reverse = not st.reverse
    elif key == ord("/"):
        st.typing = st.filter
    elif key == 27:
        st.filter = ""
    elif key in (10, 13, curses.KEY_ENTER):
        rows = st.visible()
        if rows and st.current.columns:
            st.detail, st.detail_top = rows[max(0, min(st.selected, len(rows) - 1))], 0
    else:
        for i, p in enumerate(PAGES):
            if key == ord(p.key):
                st.switch(i)
    return True


def _loop(win: Any, client: Client, interval: float) -> None:
    curses.curs_set(0)
    win.keypad(True)
    st = State()
    next_poll = 0.0
    wait = interval
    shown = (-1, "")
    while True:
        now = time.monotonic()
        if now >= next_poll or (st.page, st.current.title) != shown:
            took = poll(client, st)
            shown = (st.page, st.current.title)
            wait = next_wait(interval, took)
            next_poll = time.monotonic() + wait
        draw(win, st)
        win.timeout(max(50, int((next_poll - time.monotonic()) * 1000)))
        key = win.getch()
        if key == -1:
            continue
        if key == curses.KEY_RESIZE:
            curses.update_lines_cols()
            continue
        if not handle_key(st, key, win.getmaxyx()[0]):
            return


def run(args: argparse.Namespace, make_client: Callable[[], Client]) -> None:
    client = make_client()
    client.request("GET", "/api/whoami")  # fail before the screen is taken: bad URL or credentials
    os.environ.setdefault("ESCDELAY", "25")  # Esc acts at once, not after curses' default second
    for stale in ("LINES", "COLUMNS"):  # the terminal's own size, not an inherited one: resizes count
        os.environ.pop(stale, None)
    curses.wrapper(_loop, client, max(0.2, float(args.interval)))
