"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on the client.

uvicorn times out a connection only while it idles after a response (``timeout_keep_alive``),
and one received byte stops that timer: a client that opens a connection and sends nothing, or
a request head a byte at a time, or the rest of a body the app has already answered, holds the
connection forever. Here, whenever the server waits on the client outside the app (for a
request head, or for the unread rest of an answered request's body), the client has
``timeout_s`` from the start of that wait; then the connection is closed. A body the app is
reading is bounded by the app's own body timeout.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class ClientDeadlineProtocol(H11Protocol):
    timeout_s: float  # set by client_deadline_protocol

    def connection_made(self, transport) -> None:
        self._client_deadline = None
        super().connection_made(transport)
        self._watch_client()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_client()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_client()

    def connection_lost(self, exc) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def _waiting_on_client(self) -> bool:
        their, ours = self.conn.their_state, self.conn.our_state
        return their is h11.IDLE or (their is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE))

    def _watch_client(self) -> None:
        if self.transport.is_closing() or not self._waiting_on_client():
            self._stop_deadline()
        elif self._client_deadline is None:
            self._client_deadline = self.loop.call_later(self.timeout_s, self._deadline_passed)

    def _stop_deadline(self) -> None:
        if self._client_deadline is not None:
            self._client_deadline.cancel()
            self._client_deadline = None

    def _deadline_passed(self) -> None:
        self._client_deadline = None
        if self._waiting_on_client() and not self.transport.is_closing():
            self.transport.close()


def client_deadline_protocol(timeout_s: float) -> type[ClientDeadlineProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with the given deadline."""
    return type("ClientDeadlineProtocol", (ClientDeadlineProtocol,), {"timeout_s": timeout_s})
