"""Security headers on every response of the controller (API, web page, errors, 429/413 answers).

Installed by `create_app` around the whole middleware stack (Starlette's error middleware included), so
answers made by the other middlewares, and a 500, get the headers too. The page (`controller/api/static/`) has no inline script or style attribute and loads
nothing from another origin, so the policy allows only its own files: `script-src 'self'`, no
`unsafe-inline`. `frame-ancestors 'none'` (and X-Frame-Options for older browsers) stops framing
(clickjacking); `nosniff` stops a JSON or log answer being run as a script; no Referer leaves the page.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
)


class SecurityHeaders:
    """Adds `HEADERS` to every HTTP response start (replacing any of the same name)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [*kept, *HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)
