"""A TCP port that accepts connections and never answers: to a client, a host behind a cut
link looks the same until its timeout. It counts the connections it was offered."""

from __future__ import annotations

import socket
import threading


class SilentListener:
    """Listens on 127.0.0.1; ``accepted`` holds every connection it took (open until
    ``close`` or ``hang_up``)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="silent-listener").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.accepted.append(conn)

    def hang_up(self) -> None:
        """Close the connections taken so far (as a node closes idle ones), keep listening."""
        for conn in self.accepted:
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.hang_up()
