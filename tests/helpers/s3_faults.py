"""A TCP proxy in front of a local S3 server that injects store faults on command.

Modes (applied to new and to open connections, since boto3 keeps connections alive):
``pass``; ``down`` (connections closed at once, as a stopped server); ``stall`` (bytes held until
the mode changes: a hung server); ``error`` (each new request answered ``503 SlowDown``);
``slow`` (responses trickle at ``rate_bps``). ``arm(mode, after_bytes=N)`` keeps passing until N
more response bytes went through, then switches: a fault in the middle of a download.
"""

from __future__ import annotations

import socket
import threading
import time

from tests.helpers.net import free_port

_SLOW_DOWN_BODY = b'<?xml version="1.0"?><Error><Code>SlowDown</Code><Message>injected</Message></Error>'
SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN_BODY), _SLOW_DOWN_BODY))
CHUNK = 16 << 10


class S3FaultProxy:
    def __init__(self, target_port: int, rate_bps: int = 64 << 10) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.rate_bps = rate_bps
        self.mode = "pass"
        self._armed: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.response_bytes = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str) -> None:
        assert mode in ("pass", "down", "stall", "error", "slow"), mode
        with self._changed:
            self.mode, self._armed = mode, None
            self._changed.notify_all()

    def arm(self, mode: str, after_bytes: int) -> None:
        """``mode`` once ``after_bytes`` more response bytes have passed."""
        with self._changed:
            self.mode, self._armed = "pass", (mode, self.response_bytes + after_bytes)

    def __enter__(self) -> "S3FaultProxy":
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._accept, name="s3-faults", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.set("pass")
        self.thread.join(5)
        self.sock.close()

    # ---- plumbing -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self.mode == "down":
            _close(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            _close(client)
            return
        threading.Thread(target=self._responses, args=(upstream, client), daemon=True).start()
        self._requests(client, upstream)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(CHUNK):
                mode = self.mode
                if mode == "down":
                    break
                if mode == "error":
                    client.sendall(SLOW_DOWN)
                    break
                if mode == "stall":
                    self._wait_while("stall")
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(CHUNK):
                mode = self._account(len(data))
                if mode in ("down", "error"):
                    break
                if mode == "stall":
                    self._wait_while("stall")
                if self.mode == "slow":
                    for i in range(0, len(data), 1024):
                        client.sendall(data[i:i + 1024])
                        time.sleep(1024 / self.rate_bps)
                else:
                    client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, upstream)

    def _account(self, n: int) -> str:
        """Count response bytes; fire an armed fault when its threshold is crossed."""
        with self._changed:
            self.response_bytes += n
            if self._armed is not None and self.response_bytes >= self._armed[1]:
                self.mode, self._armed = self._armed[0], None
                self._changed.notify_all()
            return self.mode

    def _wait_while(self, mode: str) -> None:
        with self._changed:
            while self.mode == mode and not self._stop.is_set():
                self._changed.wait(0.5)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
