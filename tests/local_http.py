"""`serve`: an aiohttp app on an ephemeral loopback port, for tests that need a small
HTTP server of their own (a fake engine, a `/metrics` endpoint); `read_request` for the
raw `asyncio` servers of tests that write their answers byte by byte."""

from __future__ import annotations

import asyncio

from aiohttp import web


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The body of the next request on a connection (`Content-Length` framing), or None
    when the client has closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start `app` on 127.0.0.1 at a port the kernel picks: its runner (the caller cleans
    it up) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])
