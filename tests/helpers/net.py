"""Loopback networking for tests: free ports, a TCP proxy that can stall."""

from __future__ import annotations

import socket
import threading

from app.cli.free_ports import free_ports


def free_port() -> int:
    """A port free now that no Ray process or kernel pick will take before the test binds it."""
    return free_ports(1)[0]


class StallingProxy:
    """A TCP proxy on 127.0.0.1 to ``target_port``; when ``stalled``, it accepts and then says nothing."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.stalled = threading.Event()
        self._stop = threading.Event()

    def __enter__(self) -> "StallingProxy":
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn) -> None:
        if self.stalled.is_set():
            self._stop.wait(30)
            conn.close()
            return
        up = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(a, b):
            try:
                while data := a.recv(1 << 16):
                    if self.stalled.is_set():
                        self._stop.wait(30)
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(up, conn), daemon=True).start()
        pump(conn, up)
