"""`serve`: an aiohttp app on an ephemeral loopback port, for tests that need a small
HTTP server of their own (a fake engine, a `/metrics` endpoint)."""

from __future__ import annotations

from aiohttp import web


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start `app` on 127.0.0.1 at a port the kernel picks: its runner (the caller cleans
    it up) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])
