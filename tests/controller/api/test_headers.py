"""Security headers on every answer (API, errors, the gate's and the body limit's answers, the web page),
no CDN documentation page, and a page that needs no inline script or style (so the CSP allows none)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from deepfleet.controller.api import web
from deepfleet.controller.api.headers import CSP
from deepfleet.controller.app import create_app
from tests.controller.conftest import ADMIN_TOKEN, TestClient

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
EXPECTED = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "x-frame-options": "DENY",
            "referrer-policy": "no-referrer", "cross-origin-opener-policy": "same-origin"}


@pytest.fixture()
def served(settings):
    app = create_app(settings)
    app.include_router(web.router)
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def test_every_kind_of_answer_carries_the_headers(served) -> None:
    answers = {
        "page": served.get("/ui/"), "script": served.get("/ui/app.js"), "redirect": served.get("/", follow_redirects=False),
        "health": served.get("/healthz"), "metrics": served.get("/metrics"), "openapi": served.get("/openapi.json"),
        "list": served.get("/v1/jobs", headers=ADMIN), "401": served.get("/v1/jobs"),
        "404": served.get("/v1/jobs/" + "0" * 32, headers=ADMIN), "422": served.get("/v1/jobs?limit=0", headers=ADMIN),
        "413": served.post("/v1/jobs", content=b"x" * (65 * 1024), headers=ADMIN),
        "NUL": served.get("/v1/jobs?phase=%00", headers=ADMIN),
    }
    assert answers["413"].status_code == 413 and answers["NUL"].status_code == 422
    for what, r in answers.items():
        assert {k: r.headers.get(k) for k in EXPECTED} == EXPECTED, what


def test_even_an_unhandled_error_carries_the_headers(settings) -> None:
    app = create_app(settings)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    app.state.engine.dispose()
    assert r.status_code == 500 and {k: r.headers.get(k) for k in EXPECTED} == EXPECTED


def test_no_documentation_page_loads_scripts_from_a_cdn(served) -> None:
    assert served.get("/docs").status_code == 404 and served.get("/redoc").status_code == 404
    assert served.get("/openapi.json").json()["info"]["title"] == "deepfleet controller"


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict] = []
        self.inline: list[str] = []
        self.attrs: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs) -> None:
        self.attrs += [name for name, _ in attrs if name == "style" or name.startswith("on")]
        if tag == "script":
            self.scripts.append(dict(attrs))
            self._in_script = True
        if tag == "link":
            self.scripts.append(dict(attrs))

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append(data)


def test_the_page_has_no_inline_code_and_loads_only_its_own_files(served) -> None:
    page = _Tags()
    page.feed(served.get("/ui/").text)
    assert page.inline == [] and page.attrs == []
    assert [s.get("src") or s.get("href") for s in page.scripts] == ["/ui/style.css", "/ui/app.js"]
    script = served.get("/ui/app.js").text
    assert not re.search(r"style\s*:", script)  # no style attributes built in JS either (the CSP blocks them)
    assert "localStorage.setItem" not in script and "sessionStorage.setItem(\"deepfleet.token\"" in script
    assert "eval(" not in script and "innerHTML" not in script
