"""The HTTP front end's bounds on what a client sends, below the routes: bodies read whole here, under a size cap,
a cap on the bytes being read at once and a deadline; headers under a deadline (uvicorn's own keep-alive timeout
covers idle connections between requests). So a huge, trickled or never-finished request costs bounded memory and
time, and never reaches the JSON parser."""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tp_lora.server.errors import APIError

JSON = b"application/json"


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class BodyGuard:
    """ASGI middleware: a POST's body is read here, whole, before the app sees the request (then replayed to it;
    later receives, e.g. the client's disconnect, pass through). Refused: a Content-Type other than JSON (415: a web
    page cannot post a 'simple' cross-origin form), a body past max_body bytes (413, declared or counted as it
    arrives, read no further), one that would take the bytes being read past max_reading (503 + Retry-After),
    and one not complete within timeout_s (408)."""

    def __init__(self, app, max_body: int, max_reading: int, timeout_s: float):
        self.app, self.max_body, self.max_reading, self.timeout_s = app, max_body, max_reading, timeout_s
        self.reading = 0  # bytes reserved by the bodies being read now

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await self.read(scope, receive)
        except APIError as e:
            await e.response()(scope, receive, send)
            return
        except ClientGone:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def read(self, scope, receive) -> bytearray:
        headers = dict(scope["headers"])
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != JSON:
            raise APIError(415, f"Content-Type must be application/json, got {kind.decode('latin-1')!r}")
        declared = headers.get(b"content-length")
        size = int(declared) if declared is not None else self.max_body  # h11 has checked it is a number
        if size > self.max_body:
            raise self.too_large()
        if self.reading + size > self.max_reading:
            raise APIError(503, f"too many request bodies are being read ({self.reading} bytes of server."
                                f"max_reading_mb={self.max_reading / 2 ** 20:g} MB); retry later",
                           headers={"Retry-After": "1"})
        self.reading += size
        try:
            return await asyncio.wait_for(self.chunks(receive), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within server.body_timeout_s="
                                f"{self.timeout_s:g}s") from None
        except BodyTooLarge:
            raise self.too_large() from None
        finally:
            self.reading -= size

    async def chunks(self, receive) -> bytearray:
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            body += msg.get("body", b"")
            if len(body) > self.max_body:
                raise BodyTooLarge
            if not msg.get("more_body", False):
                return body

    def too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds server.max_body_mb={self.max_body / 2 ** 20:g} MB")


def timed_h11(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline on each request's headers, counted from the connection's start or the
    first byte after the previous response: a connection that sends nothing, or trickles its headers, is closed."""

    class TimedH11(H11Protocol):
        header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(header_timeout_s, self.headers_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            waiting = self.conn.their_state is h11.IDLE  # no complete request line + headers yet
            if waiting and self.header_timer is None:
                self.header_timer = self.loop.call_later(header_timeout_s, self.headers_late)
            elif not waiting and self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def connection_lost(self, exc):
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def headers_late(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return TimedH11
