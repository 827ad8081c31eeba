"""Parsing ``POST /admin/faults`` bodies (pure): which ``keys.faults()`` fields to set or delete.

Field names are the contract with the model processes that read them: ``load_delay_s:<model>``
(seconds), ``fail_next_load`` (model name), ``memory_pressure`` (fraction 0..1),
``hold:<model>`` ("1" while that model's process must hold every generation before its first
token), ``token_delay_s:<model>`` (seconds added before each generated token),
``step_delay_s:<model>`` (seconds added to each engine step: prompt chunks and tokens alike),
``hang:<model>`` ("1" while that model's generations block with no progress, deaf to stop,
cancel and deadline: what the stall watchdog kills), ``engine_crash:<model>`` ("1": that
model's engine thread raises at the first step of its next request, which consumes it) and
``script_text:<model>`` (a JSON list of texts: each generation that model starts takes the
first one and produces exactly its tokens, until the list is used up). A false, zero, null,
empty or ``[]`` value deletes the field, so a test can undo what it set.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from residency.errors import ApiError, bad_request
from residency.settings import check_model_name

FAULT_KEYS = (
    "load_delay_s",
    "fail_next_load",
    "memory_pressure",
    "hold",
    "token_delay_s",
    "step_delay_s",
    "hang",
    "engine_crash",
    "script_text",
)

#: Bounds of one model's script: texts in the list, and UTF-8 bytes of all of them.
MAX_SCRIPT_TEXTS = 64
MAX_SCRIPT_BYTES = 1 << 20


def _name(name: Any, param: str) -> str:
    if not isinstance(name, str):
        raise bad_request(f"'{param}' must be a model name", param)
    try:
        return check_model_name(name)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def _number(v: Any, param: str, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad_request(f"'{param}' must be a number", param)
    if not 0 <= v <= hi:
        raise bad_request(f"'{param}' must be between 0 and {hi:g}", param)
    return float(v)


def _per_model(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = body[key]
    if not isinstance(v, dict):
        raise bad_request(f"'{key}' must be an object of model name -> value", key)
    return {_name(m, f"{key}.{m}"): x for m, x in v.items()}


def _script(v: Any, param: str) -> list[str]:
    """The texts of one model's ``script_text``: a string (one generation) or a list."""
    texts = [v] if isinstance(v, str) else v
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise bad_request(f"'{param}' must be a string or a list of strings", param)
    if len(texts) > MAX_SCRIPT_TEXTS:
        raise bad_request(f"'{param}' takes at most {MAX_SCRIPT_TEXTS} texts", param)
    if sum(len(t.encode("utf-8")) for t in texts) > MAX_SCRIPT_BYTES:
        raise bad_request(f"'{param}' takes at most {MAX_SCRIPT_BYTES} bytes of text", param)
    for i, t in enumerate(texts):
        if not t:
            # An empty generation is not one the model can be made to produce token by token.
            raise bad_request(f"'{param}[{i}]' must not be empty", f"{param}[{i}]")
    return texts


def parse_faults(body: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(fields to set, fields to delete); 400 ``ApiError`` naming the bad key otherwise."""
    unknown = [k for k in body if k not in FAULT_KEYS]
    if unknown:
        raise bad_request(
            f"unknown fault {unknown[0]!r}; known: {', '.join(FAULT_KEYS)}", unknown[0]
        )
    if not body:
        raise ApiError(400, f"expected at least one of {', '.join(FAULT_KEYS)}")
    put: dict[str, str] = {}
    drop: list[str] = []
    for key in ("load_delay_s", "token_delay_s", "step_delay_s"):
        if key not in body:
            continue
        for m, v in _per_model(body, key).items():
            field = f"{key}:{m}"
            secs = 0.0 if v is None else _number(v, f"{key}.{m}", 86400)
            if secs:
                put[field] = repr(secs)
            else:
                drop.append(field)
    if "fail_next_load" in body:
        v = body["fail_next_load"]
        if v in (None, "", False):
            drop.append("fail_next_load")
        else:
            put["fail_next_load"] = _name(v, "fail_next_load")
    if "memory_pressure" in body:
        v = body["memory_pressure"]
        frac = 0.0 if v is None else _number(v, "memory_pressure", 1)
        if frac:
            put["memory_pressure"] = repr(frac)
        else:
            drop.append("memory_pressure")
    for key in ("hold", "hang", "engine_crash"):
        if key not in body:
            continue
        for m, v in _per_model(body, key).items():
            if v is not None and not isinstance(v, bool):
                raise bad_request(f"'{key}.{m}' must be a boolean", f"{key}.{m}")
            if v:
                put[f"{key}:{m}"] = "1"
            else:
                drop.append(f"{key}:{m}")
    if "script_text" in body:
        for m, v in _per_model(body, "script_text").items():
            texts = [] if v in (None, "", False) else _script(v, f"script_text.{m}")
            if texts:
                put[f"script_text:{m}"] = json.dumps(texts)
            else:
                drop.append(f"script_text:{m}")
    return put, drop
