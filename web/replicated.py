"""An admin change is answered only once a replica holds it (on a Sentinel-backed bus).

Redis replicates asynchronously: a primary that dies right after acknowledging a write may take
it along, and the replica the sentinels promote never saw it. So on a Sentinel URL, every
successful admin write (``POST``/``PUT``/``PATCH``/``DELETE`` under ``/admin``) waits, before
its answer goes out, until ``server.redis_min_replicas`` replicas acknowledge every write so far
(``WAIT``, bounded by ``server.redis_wait_ms``). If they do not, the answer is 503
``not_replicated``: the change is on the primary but not promised to survive a failover.
"""

from __future__ import annotations

import logging

import redis
from flask import Response, request

from residency.errors import ApiError
from residency.redis_conn import NotReplicated, confirm_replicated, is_sentinel
from web import bus
from web.responses import error_response
from web.state import state

log = logging.getLogger(__name__)

ADMIN_BLUEPRINTS = frozenset({"admin", "admin_users"})
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# POSTs under /admin that change nothing: no wait for them.
READ_ONLY = frozenset({"admin.validate_policy"})


def confirm(response: Response) -> Response:
    """``after_request``: wait for the replicas after a successful admin write."""
    if (
        request.blueprint not in ADMIN_BLUEPRINTS
        or request.method not in WRITES
        or request.endpoint in READ_ONLY
        or response.status_code >= 400
    ):
        return response
    st = state()
    if not is_sentinel(st.box.redis_url):
        return response
    srv = st.cached().settings.server
    if srv.redis_min_replicas == 0:
        return response
    try:
        confirm_replicated(st.r, srv.redis_min_replicas, srv.redis_wait_ms)
    except NotReplicated as e:
        log.warning("%s %s applied on the primary only: %s", request.method, request.path, e)
        return error_response(
            ApiError(
                503,
                f"the change was applied on the Redis primary but {e} "
                "(server.redis_min_replicas); it may be lost if the primary fails now: "
                "check the replicas, then read it back or send it again",
                type="server_error",
                code="not_replicated",
                retry_after=1,
            )
        )
    except (redis.ConnectionError, redis.TimeoutError) as e:
        return error_response(bus.storage_unavailable(e))
    return response
