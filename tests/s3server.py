"""A real S3-compatible server on 127.0.0.1 for the tests (moto's server), and a relay that can cut it off.

moto_server is a separate process speaking the S3 protocol over HTTP, as AWS, MinIO or R2
do; the code under test reaches it only through the AWS_* variables. It keeps its objects
in memory, so a store outage is made with Relay, a TCP forwarder in front of it that stops
accepting and resets its connections, while the server keeps what it holds.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from parallel import distributed


def start_server(bucket: str, timeout: float = 60) -> tuple[subprocess.Popen, dict[str, str]]:
    """(moto_server process, the AWS_* variables that reach it) with bucket created; kill the process when done.

    Raises RuntimeError if moto_server is not installed (pip install -e ".[dev]") or does not
    accept the bucket within timeout seconds.
    """
    exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(exe):
        raise RuntimeError("moto_server is not installed: pip install -e \".[dev]\" (moto[server])")
    port = distributed.free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "testsecret", "AWS_DEFAULT_REGION": "us-east-1"}
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    make = subprocess.run([sys.executable, "-c", f"import s3fs; s3fs.S3FileSystem().mkdir({bucket!r})"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    if make.returncode != 0:
        proc.kill()
        raise RuntimeError(f"moto_server did not create bucket {bucket}: {make.stderr[-500:]}")
    return proc, env


class Relay:
    """Forwards 127.0.0.1:port to target_port; down() refuses and resets connections, up() accepts again."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, distributed.free_port()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        """Connections are refused and open ones reset, as when a store's endpoint is gone."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:  # shutdown, not close alone: a thread blocked in accept() would keep the socket listening
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for c in self._conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                c.close()
            except OSError:
                pass
        self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
