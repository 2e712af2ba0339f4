"""The web page: plain HTML + JS served by the controller (no build step), on top of the REST API.

`create_app` includes `router`. The page (`static/index.html`, `static/app.js`, `static/style.css`)
submits a YAML spec and shows the API's field-path errors inline, lists jobs with their phase, and
shows one job's events, log tail and a loss / throughput plot drawn as inline SVG from heartbeats.
It calls the same `/v1` endpoints as the CLI with the bearer token the user pastes (kept in the tab's
sessionStorage, docs/security.md says why). It has no inline script or style attribute, so it runs under
the strict CSP of `controller/api/headers.py`. Files are served from a fixed list, so no path from the
URL reaches the disk.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

STATIC = Path(__file__).with_name("static")
FILES = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}

router = APIRouter(include_in_schema=False)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui/")
def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/ui/{name}")
def static_file(name: str) -> FileResponse:
    if name not in FILES:
        return FileResponse(STATIC / "index.html", media_type="text/html", status_code=404)
    return FileResponse(STATIC / name, media_type=FILES[name], headers={"Cache-Control": "no-cache"})
