"""One guest connection, relayed to a loopback TCP port (QEMU ``guestfwd=...-cmd:``).

QEMU user networking forwards a guest connection to ``guestfwd`` address to a
character device; a ``tcp:`` chardev carries only one connection for the whole VM,
so the tests use ``cmd:python3 guestfwd_relay.py 127.0.0.1 PORT``: QEMU starts this
script for every guest connection with the connection on stdin/stdout, and it copies
bytes both ways to the test's listener on the host's loopback. Nothing else is
reachable from the guest (``restrict=on``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def main(argv: list[str]) -> int:
    host, port = argv[1], int(argv[2])
    if host not in ("127.0.0.1", "::1", "localhost"):
        print("guestfwd_relay: only loopback targets are allowed", file=sys.stderr)
        return 2
    guest = socket.socket(fileno=os.dup(0))
    upstream = socket.create_connection((host, port), timeout=30)
    upstream.settimeout(None)
    back = threading.Thread(target=_pump, args=(upstream, guest), daemon=True)
    back.start()
    _pump(guest, upstream)
    back.join(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
