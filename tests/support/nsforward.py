"""Forward TCP from the host's loopback into a network namespace: ``python -m tests.support.nsforward``.

Usage (the parent makes the listening socket on the host, then starts this inside the namespace)::

    nsenter --net=/run/netns/NS python -m tests.support.nsforward FD=HOST:PORT [FD=HOST:PORT ...]

Each ``FD`` is an inherited socket already listening in the host's namespace; every connection
accepted on it is joined to a new connection to ``HOST:PORT`` made inside the namespace this process
runs in. Bytes are copied both ways unchanged (TLS passes through end to end), with half-closes
passed on. SIGTERM ends it. This lets tests, benches and people on the host reach an API server that
binds 127.0.0.1 inside the control plane's namespace, without an address or a route outside it.
"""

from __future__ import annotations

import asyncio
import socket
import sys

_CHUNK = 1 << 16


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


async def _join(host: str, port: int, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(host, port)
    except OSError:
        down_w.close()
        return
    try:
        await asyncio.gather(_copy(down_r, up_w), _copy(up_r, down_w))
    finally:
        for w in (up_w, down_w):
            w.close()


async def _main(specs: list[tuple[int, str, int]]) -> None:
    servers = []
    for fd, host, port in specs:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)

        async def handle(
            r: asyncio.StreamReader, w: asyncio.StreamWriter, host: str = host, port: int = port
        ) -> None:
            await _join(host, port, r, w)

        servers.append(await asyncio.start_server(handle, sock=sock))
    await asyncio.gather(*(s.serve_forever() for s in servers))


def parse(args: list[str]) -> list[tuple[int, str, int]]:
    """``["3=127.0.0.1:6443"]`` -> ``[(3, "127.0.0.1", 6443)]``; SystemExit with usage on anything else."""
    specs = []
    for arg in args:
        fd, sep, target = arg.partition("=")
        host, colon, port = target.rpartition(":")
        if not (
            sep and colon and fd.isascii() and fd.isdigit() and port.isascii() and port.isdigit() and host
        ):
            raise SystemExit(f"usage: python -m tests.support.nsforward FD=HOST:PORT ...; got {arg!r}")
        specs.append((int(fd), host, int(port)))
    if not specs:
        raise SystemExit("usage: python -m tests.support.nsforward FD=HOST:PORT ...")
    return specs


if __name__ == "__main__":
    asyncio.run(_main(parse(sys.argv[1:])))
