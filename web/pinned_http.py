"""An HTTP session that connects to an address chosen before it was made.

``requests`` resolves a URL's host name itself, when it connects. A caller that checked the
addresses of that name first would then connect to whatever a second lookup answers (DNS
rebinding). ``pinned_session(ip)`` returns a session whose every connection goes to ``ip``, while
the URL keeps its host name, so the ``Host`` header, TLS SNI and certificate verification are
those of the name. The session ignores the environment (``trust_env = False``): no proxy
variables (a proxy would do its own lookup, and see the API key), no ``.netrc`` credentials.
``on_connect``, when given, is told of each connection's socket once it is connected (before
any TLS): a caller that must end a connection at a deadline of its own finds it there.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
from urllib3.util import connection


class _Pinned:
    """Mixin of a urllib3 connection: its socket goes to ``pinned_ip``, never to a lookup of
    its host name."""

    pinned_ip = ""
    on_connect: Callable[[socket.socket], None] | None = None
    port: int
    timeout: Any
    source_address: Any
    socket_options: Any

    def _new_conn(self) -> socket.socket:
        try:
            # An address literal: create_connection's getaddrinfo does no lookup for it.
            sock = connection.create_connection(
                (self.pinned_ip, self.port),
                self.timeout,
                source_address=self.source_address,
                socket_options=self.socket_options,
            )
        except TimeoutError as e:
            raise ConnectTimeoutError(self, f"connection to {self.pinned_ip} timed out") from e
        except OSError as e:
            raise NewConnectionError(self, f"could not connect to {self.pinned_ip}: {e}") from e  # type: ignore[arg-type]
        if self.on_connect is not None:
            self.on_connect(sock)
        return sock


class _Adapter(HTTPAdapter):
    def __init__(self, ip: str, on_connect: Callable[[socket.socket], None] | None) -> None:
        self._ip = ip
        self._on_connect = on_connect
        super().__init__(max_retries=0)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        attrs: dict[str, Any] = {"pinned_ip": self._ip}
        if self._on_connect is not None:
            # staticmethod: a plain function stored on a class is called as a method.
            attrs["on_connect"] = staticmethod(self._on_connect)
        http = type("PinnedHTTPConnection", (_Pinned, HTTPConnection), attrs)
        https = type("PinnedHTTPSConnection", (_Pinned, HTTPSConnection), attrs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": type("PinnedHTTPPool", (HTTPConnectionPool,), {"ConnectionCls": http}),
            "https": type("PinnedHTTPSPool", (HTTPSConnectionPool,), {"ConnectionCls": https}),
        }


def pinned_session(
    ip: str, on_connect: Callable[[socket.socket], None] | None = None
) -> requests.Session:
    """A session whose connections all go to ``ip`` (see the module's docstring)."""
    s = requests.Session()
    s.trust_env = False
    adapter = _Adapter(ip, on_connect)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s
