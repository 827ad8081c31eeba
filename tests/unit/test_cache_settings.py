"""``[cache] scope``: validated like every key, live (an admin patch takes it), and carried by
each request to the model process (pure: no Redis)."""

from __future__ import annotations

import pytest

from residency import settings as st
from residency.messages import Kind, Request


def test_the_default_scope_is_the_users_own() -> None:
    assert st.build({}).cache.scope == "user"
    assert Request("id", Kind.CHAT, "m", {}, False, 0.0).cache_scope == "user"


def test_an_unknown_scope_is_refused_naming_the_key() -> None:
    with pytest.raises(st.SettingsError) as e:
        st.build({"cache": {"scope": "everyone"}})
    assert set(e.value.problems) == {"cache.scope"}
    with pytest.raises(st.SettingsError) as e:
        st.validate_patch(st.build({}), {"cache": {"scope": "everyone"}})
    assert set(e.value.problems) == {"cache.scope"}


def test_the_scope_is_live_and_every_value_is_accepted() -> None:
    assert st.key_meta()["cache.scope"]["applies"] == st.LIVE
    for scope in st.CACHE_SCOPES:
        assert st.validate_patch(st.build({}), {"cache": {"scope": scope}}) == {
            "cache.scope": scope
        }


def test_a_request_carries_its_scope_through_the_queue() -> None:
    req = Request("id", Kind.CHAT, "m", {}, False, 0.0, user="ann", cache_scope="global")
    assert Request.loads(req.dumps()) == req
    # A request queued before the field existed reads as the safe default.
    assert Request.loads(req.dumps().replace(',"cache_scope":"global"', "")).cache_scope == "user"
