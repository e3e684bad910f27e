#!/usr/bin/env python3
"""How long the management API takes to answer what the web UI asks for, with many queues.

The UI's queue list asks for one page (``/api/queues?page=1&page_size=50&sort=name``), never the
whole list. This declares ``--queues`` queues on a running broker (Skred or RabbitMQ, both serve
the same API), then times each of the UI's requests ``--runs`` times and prints the median and the
maximum in milliseconds. It deletes the queues it declared.

With ``--browser`` it also opens the UI's queues page in headless Chromium (selenium, as the UI
tests) and prints its time to interactive: ``performance.now()`` (from navigation start) when
the first page of rows is in the DOM, the best and median of ``--runs`` loads after one warm-up.
The history requests (``?lengths_age=...``) time the charts' reads of a queue and the overview.

    python benchmarks/mgmt_pages.py --amqp amqp://guest:guest@127.0.0.1:5672/ \\
        --http http://127.0.0.1:15672 --queues 10000
"""

from __future__ import annotations

import argparse
import base64
import shutil
import statistics
import time
import urllib.request
import uuid

import pika

REQUESTS = [
    "/api/overview",
    "/api/queues?page=1&page_size=50&sort=name&sort_reverse=false",
    "/api/queues?page=1&page_size=50&sort=messages_ready&sort_reverse=true",
    "/api/queues?page=1&page_size=50&name=^bench-9&use_regex=true",
    "/api/exchanges?page=1&page_size=50&sort=name",
    "/api/overview?lengths_age=86400&lengths_incr=1800&msg_rates_age=86400&msg_rates_incr=1800",
    "/api/queues/%2F/bench-0?lengths_age=600&lengths_incr=5&msg_rates_age=600&msg_rates_incr=5",
]
# In the page: resolve with performance.now() once the queue list's first page of links is drawn.
TTI_SCRIPT = ("const done = arguments[arguments.length - 1];"
              "(function poll() { if (document.querySelectorAll('#main tbody tr a').length >= 50)"
              " done(performance.now()); else requestAnimationFrame(poll); })();")


def browser_tti(http: str, user: str, password: str, runs: int) -> list[float]:
    """Milliseconds from navigation start to the queues page's rows, one figure per load."""
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1366,900"):
        opts.add_argument(arg)
    # the system's chromium and chromedriver, named, so that selenium never looks for a driver online
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver") or "chromedriver")
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_script_timeout(60)
    try:
        driver.get(http + "/")
        auth = base64.b64encode(f"{user}:{password}".encode()).decode()
        driver.execute_script("sessionStorage.setItem('skred.auth', arguments[0]); localStorage.clear()",
                              auth)
        times = []
        for _ in range(runs + 1):
            driver.get("about:blank")
            driver.get(http + "/#/queues")
            times.append(float(driver.execute_async_script(TTI_SCRIPT)))
        return times[1:]
    finally:
        driver.quit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--http", default="http://127.0.0.1:15672")
    ap.add_argument("--user", default="guest")
    ap.add_argument("--password", default="guest")
    ap.add_argument("--queues", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--browser", action="store_true", help="also time the UI's queues page in Chromium")
    args = ap.parse_args()
    auth = "Basic " + base64.b64encode(f"{args.user}:{args.password}".encode()).decode()
    prefix = f"bench-{uuid.uuid4().hex[:4]}-"
    conn = pika.BlockingConnection(pika.URLParameters(args.amqp))
    ch = conn.channel()
    started = time.monotonic()
    for i in range(args.queues):
        ch.queue_declare(f"{prefix}{i}")
        if i and i % 2000 == 0:
            print(f"declared {i} queues ({time.monotonic() - started:.0f} s)", flush=True)
    try:
        print(f"{'request':<75} {'median ms':>10} {'max ms':>8}")
        for template in REQUESTS:
            path = template.replace("^bench-", "^" + prefix).replace("bench-0", prefix + "0")
            times = []
            for _ in range(args.runs):
                req = urllib.request.Request(args.http + path,
                                             headers={"Authorization": auth})
                t0 = time.perf_counter()
                with urllib.request.urlopen(req, timeout=60) as resp:
                    resp.read()
                times.append((time.perf_counter() - t0) * 1000)
            print(f"{template:<75} {statistics.median(times):>10.1f} {max(times):>8.1f}")
        if args.browser:
            tti = browser_tti(args.http, args.user, args.password, args.runs)
            print(f"{'UI queues page, time to interactive (Chromium)':<75} {statistics.median(tti):>10.1f} "
                  f"{max(tti):>8.1f}  (best {min(tti):.0f} ms, {args.queues:,} queues)")
    finally:
        for i in range(args.queues):
            ch.queue_delete(f"{prefix}{i}")
        conn.close()


if __name__ == "__main__":
    main()
