"""ASGI layers around the server's routes: bearer authentication, and a JSON answer to any error
nothing else handled.

Why the catch-all: Starlette's outermost error layer sends its plain-text 500 and then re-raises,
and uvicorn closes the connection of an application that raised after starting its response
(``RequestResponseCycle.run_asgi``), so a client's pooled keep-alive connection broke without
notice. Answering here, without re-raising, leaves the connection usable.
"""

from __future__ import annotations

import hmac
import json
import logging

log = logging.getLogger("fastjudge")


async def send_json(send, status: int, payload: dict, headers: list | None = None) -> None:
    """A complete JSON response through the ASGI ``send``."""
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class JsonErrors:
    """Any exception a route lets out becomes a logged JSON 500 (``{"error": ...}``), and the
    connection stays open for the client's next request. A response already started cannot be
    replaced: then the exception goes on to the server, which closes that one connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            if started:
                raise
            await send_json(send, 500, {"error": "internal server error; the server log has "
                                                 "the details"})


class BearerAuth:
    """``Authorization: Bearer <api_key>`` on every route but ``open_paths`` (the health probe
    of load balancers and orchestrators); otherwise 401 with the challenge of RFC 6750
    (``WWW-Authenticate: Bearer``, with ``error="invalid_token"`` when a wrong key was sent).
    Keys are compared in constant time."""

    def __init__(self, app, api_key: str, open_paths: frozenset = frozenset()):
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if given is None or scheme.lower() != b"bearer":
            challenge, message = b"Bearer", ("this server needs an API key: send the header "
                                             "Authorization: Bearer <key>")
        elif not hmac.compare_digest(token.strip(), self.api_key):
            challenge, message = b'Bearer error="invalid_token"', "wrong API key"
        else:
            return await self.app(scope, receive, send)
        await send_json(send, 401, {"error": message}, [(b"www-authenticate", challenge)])
