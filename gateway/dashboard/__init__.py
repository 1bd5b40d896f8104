"""The built-in live dashboard: ``GET /dashboard`` (one self-contained page) and its data.

The page (``page.html``: inline CSS and JS, no build step, no CDN, no external fonts) carries no
numbers and no secret, so it is served to anyone; it polls ``GET /dashboard/data`` every 2 s,
which answers only with the admin key where one is configured. The key reaches the page as a URL
fragment (``/dashboard#key=…``), which browsers never send to the server, and goes only into the
``Authorization`` header of the data requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from importlib.resources import files

from aiohttp import web

from gateway.dashboard.data import DashboardSource
from gateway.state import GATEWAY

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DASHBOARD_SOURCE = web.AppKey("dashboard_source", DashboardSource)
_PAGE = files(__package__).joinpath("page.html")


async def page(request: web.Request) -> web.Response:
    """The page itself (static): it fetches everything it shows from ``/dashboard/data``."""
    return web.Response(
        text=_PAGE.read_text(encoding="utf-8"),
        content_type="text/html",
        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
    )


async def data(request: web.Request) -> web.Response:
    """Everything the page shows, as JSON (``gateway/dashboard/data.py``)."""
    built = await request.app[DASHBOARD_SOURCE].build(request.app[GATEWAY])
    return web.json_response(dataclasses.asdict(built), headers={"Cache-Control": "no-store"})


def add_dashboard_routes(app: web.Application, guard: Callable[[Handler], Handler]) -> None:
    """Mount ``/dashboard`` and ``/dashboard/data`` (the latter behind ``guard``)."""
    app[DASHBOARD_SOURCE] = DashboardSource()
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/data", guard(data))
