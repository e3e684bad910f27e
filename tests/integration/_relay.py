"""A TCP relay for tests: splices each accepted connection to a target, optionally sending a
prefix first (a PROXY header) from a chosen source address, and optionally recording the bytes
that cross it (to check a link is not plaintext), or handing what each client sends to a tap
made per connection (to count a link's frames), and optionally going silent (``freeze``:
every byte from then on is dropped, no connection closed, as over a cut network). Threads,
blocking sockets, loopback only.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class Relay:
    def __init__(self, target: tuple[str, int], *, source: str | None = "127.0.0.1",
                 prefix: Callable[[tuple[str, int]], bytes] | None = None, record: bool = False,
                 listen: str = "127.0.0.1", tap: Callable[[], Callable[[bytes], None]] | None = None) -> None:
        self.target = target
        self.source = source
        self.prefix = prefix
        self.record = record
        self.tap = tap  # per accepted connection: a callback given each chunk its client sends
        self.captured = bytearray()  # both directions, in arrival order
        self._lock = threading.Lock()
        self._sock = socket.create_server((listen, 0))
        self.port = int(self._sock.getsockname()[1])
        self._open: list[socket.socket] = []
        self._closed = False
        self._frozen = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, addr = self._sock.accept()
            except OSError:
                return
            try:
                source = self.source or str(addr[0])  # None: connect from the client's own address
                upstream = socket.create_connection(self.target, timeout=10, source_address=(source, 0))
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            if self.prefix is not None:
                upstream.sendall(self.prefix((str(addr[0]), int(addr[1]))))
            tap = self.tap() if self.tap is not None else None
            for a, b, seen in ((client, upstream, tap), (upstream, client, None)):
                threading.Thread(target=self._pump, args=(a, b, seen), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, tap: Callable[[bytes], None] | None) -> None:
        try:
            while data := src.recv(65536):
                if self._frozen.is_set():
                    continue  # a cut link: dropped, and nobody told
                if self.record:
                    with self._lock:
                        self.captured += data
                dst.sendall(data)
                if tap is not None:
                    tap(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def freeze(self) -> None:
        """From now on drop every byte both ways, closing nothing (a silent, cut link)."""
        self._frozen.set()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            for s in self._open:
                s.close()
