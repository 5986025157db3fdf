"""The comparison page at ``/``: three files shipped in the package (``page/``), read once
and served from memory, so no request path ever reaches the filesystem."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FILES = {"index.html": "text/html; charset=utf-8",
         "page.js": "text/javascript; charset=utf-8",
         "page.css": "text/css; charset=utf-8"}
# The page loads only its own script and style and talks only to this server; no
# inline code runs, nothing frames it.
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; "
           "style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; "
           "form-action 'none'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def page_routes() -> list[Route]:
    """``GET /`` (the page) and ``GET /page/page.js``, ``/page/page.css``."""
    folder = resources.files("lmforge.serve") / "page"
    routes = []
    for name, media_type in FILES.items():
        body = (folder / name).read_bytes()

        async def serve(request: Request, body: bytes = body, media_type: str = media_type
                        ) -> Response:
            return Response(body, media_type=media_type, headers=HEADERS)

        path = "/" if name == "index.html" else f"/page/{name}"
        routes.append(Route(path, serve, methods=["GET"]))
    return routes
