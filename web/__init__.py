"""The web role: Flask front ends (OpenAI API, admin API, health, metrics) under gunicorn.

Imports ``residency`` only, never ``coordinator`` or ``workers``.
"""

from __future__ import annotations

from web.app import create_app

__all__ = ["create_app"]
