"""Bulk transfer through a follower proxy's client tunnel, in this process: a client on the
proxy, a real LeaderSink, a listener on the leader side; MB/s up (client -> listener) and down,
and the process's CPU time per GB (steadier than a rate on a shared machine).

    python benchmarks/tunnel_bulk.py [--mb 200] [--tls]
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.cluster import codec  # noqa: E402
from broker.cluster.leader import LeaderSink  # noqa: E402
from broker.cluster.proxy import SpliceProxy, Target, Tunnelled  # noqa: E402

SECRET = b"s" * 32
BLOCK = b"x" * 65536


async def _no_isr(members: list[str]) -> bool:
    return True


async def main(total: int, tls: bool, workdir: Path) -> None:
    server_ctx = client_ctx = None
    if tls:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
        from _tls import make_pki  # type: ignore[import-not-found]
        pki = make_pki(workdir / "pki")
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(pki.server.cert, pki.server.key)
        client_ctx = pki.client_context()

    async def far_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        mode = await r.readexactly(1)
        if mode == b"u":  # upload: count, then one byte back
            left = total
            while left:
                left -= len(await r.read(65536))
            w.write(b"k")
        else:
            for _ in range(total // len(BLOCK)):
                w.write(BLOCK)
                await w.drain()
        await w.drain()
        w.close()

    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: None)  # teardown noise
    listener = await asyncio.start_server(far_end, "127.0.0.1", 0)
    sink = LeaderSink(workdir, "L", SECRET, _no_isr)
    _h, port = await sink.start("127.0.0.1", 0, server_ctx)
    sink.client_addresses = lambda: {"amqp": ("127.0.0.1", listener.sockets[0].getsockname()[1])}
    tunnelled = Tunnelled(codec.AMQP_PORT, lambda: SECRET, lambda: client_ctx)
    proxy = SpliceProxy("AMQP", Target("localhost", port), False, None, tunnelled)
    pport = await proxy.start("127.0.0.1", 0)
    for mode in (b"u", b"d"):
        r, w = await asyncio.open_connection("127.0.0.1", pport)
        t0, c0 = time.perf_counter(), time.process_time()
        w.write(mode)
        if mode == b"u":
            for _ in range(total // len(BLOCK)):
                w.write(BLOCK)
                await w.drain()
            await r.readexactly(1)
        else:
            left = total
            while left:
                left -= len(await r.read(1 << 20))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"{'tls' if tls else 'clear'} {'up' if mode == b'u' else 'down'}: {total / dt / 1e6:.0f} MB/s, "
              f"{cpu / total * 1e9:.2f} CPU s/GB (every hop in this one process)")
        w.close()
    await proxy.stop()
    await sink.stop()
    listener.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--tls", action="store_true")
    a = ap.parse_args()
    import uvloop  # the broker's event loop
    with tempfile.TemporaryDirectory() as d:
        uvloop.run(main(a.mb * 1_000_000 // 65536 * 65536, a.tls, Path(d)))
