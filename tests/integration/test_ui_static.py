"""The dashboard's files as web serves them (the browser test is tests/e2e/test_dashboard.py):
public, no secret in them, a strict Content-Security-Policy, the settings schema, and every
element the script looks up by id present in the page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
from flask.testing import FlaskClient

from residency.box import Box
from residency.settings import LIVE, key_meta
from web import create_app
from web.ui import STATIC

ADMIN = "test-admin-key"


@pytest.fixture
def client(tmp_path: Path, redis_url: str, r: redis.Redis) -> FlaskClient:
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=redis_url,
        environ={"RESIDENCY_ADMIN_KEY": ADMIN},
    )
    return create_app(box).test_client()


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/admin/ui", "text/html"),
        ("/admin/ui/", "text/html"),
        ("/admin/ui/app.js", "text/javascript"),
        ("/admin/ui/style.css", "text/css"),
    ],
)
def test_files_are_public_with_a_strict_policy(client: FlaskClient, path: str, kind: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 200
    assert resp.mimetype == kind
    csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert ADMIN.encode() not in resp.data


def test_other_paths_are_not_served(client: FlaskClient) -> None:
    for path in ("/admin/ui/nope.js", "/admin/ui/../ui.py", "/admin/ui/static/index.html"):
        assert client.get(path).status_code == 404
    # The data stays behind the admin API's key.
    assert client.get("/admin/config").status_code == 401


def test_settings_schema_lists_the_live_keys(client: FlaskClient) -> None:
    keys = client.get("/admin/ui/settings.json").get_json()["keys"]
    assert keys == {k: {**m} for k, m in key_meta().items()}
    assert keys["pool.max_loaded_models"]["applies"] == LIVE


def test_every_id_the_script_uses_is_in_the_page() -> None:
    page = (STATIC / "index.html").read_text()
    script = (STATIC / "app.js").read_text()
    ids = set(re.findall(r'id="([^"]+)"', page))
    used = set(re.findall(r'\$\("([^"]+)"\)', script))
    assert used and used <= ids, used - ids
    # No inline script or style (the policy would block them) and nothing from elsewhere.
    assert "<script>" not in page and "style=" not in page
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
