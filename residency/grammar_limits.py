"""What a JSON schema may cost once it becomes a sampling grammar, and the schema rewritten to
stay within it (pure; web and model processes both need it).

llama.cpp's converter writes a bounded repeat (``maxLength``, ``maxItems``, a pattern's
``{n,m}``...) out as one copy of its item per repetition, so a bound of 524288 is a grammar of
half a million rules. Clients send such bounds as plain limits on a tool's input (a coding
agent's "file content" parameter), not as something they need sampled: a bound past
``MAX_SCHEMA_REPEAT`` is dropped before the schema is converted (``unbounded``), so it compiles
as unbounded instead of being refused. What stays refused where a grammar is built is what
costs per token, not per rule: repeats nested inside repeats in a ``pattern``
(``residency.pattern_cost``), measured on the rewritten pattern.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from residency.pattern_cost import nesting

#: Largest JSON schema (compact JSON, bytes) in response_format or one tool's parameters, and
#: the largest union of calls one grammar is built from.
MAX_SCHEMA_BYTES = 64 * 1024
#: Largest count kept in a schema's minItems/maxItems/minLength/maxLength... and in a
#: pattern's {n,m}: past it the bound is dropped (the grammar is written once per repetition).
MAX_SCHEMA_REPEAT = 256
#: Largest product of a pattern's repeats nested inside each other: nested, they multiply the
#: places llama.cpp's grammar parser tracks at once, so together they may not exceed what one
#: flat repeat may be.
MAX_PATTERN_NESTING = MAX_SCHEMA_REPEAT

COUNTS = frozenset(
    {
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "minLength",
        "maxLength",
        "minContains",
        "maxContains",
    }
)
#: Keywords whose values are data, not schemas: nothing in them is a bound.
_DATA = frozenset({"const", "enum", "default", "examples"})
#: Keywords whose values map names to schemas (a property may be named "const" or "pattern").
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_QUANT = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")


def _past(digits: str) -> bool:
    # Length first: int() refuses strings of thousands of digits.
    return bool(digits) and (len(digits) > 9 or int(digits) > MAX_SCHEMA_REPEAT)


def unbounded_pattern(pattern: str) -> str:
    """``pattern`` with each ``{n,m}`` whose bound passes the limit made open: an upper bound
    past it is dropped (``{n,}``), and so is a lower one (``{0,}``). Escapes and classes are
    copied as they are."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[":
            j = i + 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i : j + 1])
            i = j + 1
            continue
        m = _QUANT.match(pattern, i) if c == "{" else None
        if m is not None and (m[1] or m[3]) and (_past(m[1]) or _past(m[3] or "")):
            lo = "0" if _past(m[1]) or not m[1] else m[1]
            out.append(f"{{{lo},}}")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


def pattern_nesting(pattern: str) -> int:
    """The repeat product of ``pattern`` as it is compiled (bounds past the limit dropped),
    or ``MAX_PATTERN_NESTING + 1`` once past the limit."""
    body = unbounded_pattern(pattern).removeprefix("^").removesuffix("$")
    return nesting(body, MAX_PATTERN_NESTING)


def unbounded(schema: Any, loosen: bool = False) -> Any:
    """A copy of ``schema`` as a grammar is built from it: counts past ``MAX_SCHEMA_REPEAT``
    dropped, patterns' repeats opened (``unbounded_pattern``). ``loosen``: a pattern whose
    nested repeats are past the limit is dropped too (the string is then any string), for a
    grammar that only shapes an answer the model may give (``tool_choice: "auto"``), where
    refusing the request for one tool's pattern would be worse than not enforcing it."""
    if isinstance(schema, list):
        return [unbounded(v, loosen) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, v in schema.items():
        if key in COUNTS and _is_count(v) and v > MAX_SCHEMA_REPEAT:
            continue
        if key == "pattern" and isinstance(v, str):
            if loosen and pattern_nesting(v) > MAX_PATTERN_NESTING:
                continue
            out[key] = unbounded_pattern(v)
        elif key in _DATA:
            out[key] = v
        elif key in _MAPS and isinstance(v, dict):
            out[key] = {name: unbounded(sub, loosen) for name, sub in v.items()}
        else:
            out[key] = unbounded(v, loosen)
    return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def costly_patterns(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    """Each ``(path, pattern)`` in ``schema`` whose nested repeats multiply past the limit.
    The body's nesting is bounded (web.body): a stack, not recursion."""
    stack: list[tuple[str, Any]] = [(path, schema)]
    while stack:
        here, node = stack.pop()
        if isinstance(node, list):
            stack.extend((f"{here}[{i}]", v) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, v in node.items():
            p = f"{here}.{key}"
            if key == "pattern" and isinstance(v, str):
                if pattern_nesting(v) > MAX_PATTERN_NESTING:
                    yield p, v
            elif key in _MAPS and isinstance(v, dict):
                stack.extend((f"{p}.{name}", sub) for name, sub in v.items())
            elif key not in _DATA and isinstance(v, dict | list):
                stack.append((p, v))
