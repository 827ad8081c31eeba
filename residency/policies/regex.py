"""Regex leaves on RE2: what a pattern may be, what it costs, and matching it against a text.

Policy regexes run in web request threads on text a client chose, so they run on RE2
(google-re2), whose matching time is linear in the text for every pattern: no backtracking, so
no pattern can freeze a worker the way ``(x+)+y`` does on Python's ``re``. RE2 has no
backreferences and no lookaround; a pattern that needs them does not compile and is refused
when the policy is validated.

Linear is in the text only: in the worst case (RE2's DFA gives up and its NFA runs) a search
costs about (program size x text bytes). Both factors are capped: a policy's regexes together
may compile to at most :data:`MAX_POLICY_REGEX_PROGRAM` instructions, and a regex sees at most
:data:`REGEX_INPUT_CAP` bytes of the text, which bounds one request's regex work to well under
a second even for a pattern written to be slow (usual ones compile to 5-150 instructions and
run at DFA speed).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import re2

#: Regex leaves see at most this many UTF-8 bytes of the text (the start of it).
REGEX_INPUT_CAP = 64 * 1024
#: Longest accepted regex source, far above any hand-written rule.
MAX_REGEX_LEN = 4096
#: RE2 program size (compiled instructions) all regex leaves of one policy may add up to.
MAX_POLICY_REGEX_PROGRAM = 1000

_OPTIONS = re2.Options()
# A refused pattern is reported to the admin who wrote it; RE2 would also log it to stderr.
_OPTIONS.log_errors = False


@lru_cache(maxsize=1024)
def compiled(pattern: str) -> Any:
    """The RE2 regex of ``pattern``; raises ``re2.error`` when RE2 cannot compile it."""
    return re2.compile(pattern, _OPTIONS)


def _compile_error(e: Exception) -> str:
    msg = e.args[0] if e.args else str(e)
    if isinstance(msg, bytes):
        msg = msg.decode("utf-8", errors="replace")
    return str(msg)


def regex_problem(pattern: Any) -> str | None:
    """Why ``pattern`` is not an acceptable regex leaf, or None."""
    if not isinstance(pattern, str) or not pattern:
        return "must be a non-empty string"
    if len(pattern) > MAX_REGEX_LEN:
        return f"longer than {MAX_REGEX_LEN} characters"
    try:
        rx = compiled(pattern)
    except re2.error as e:
        return (
            f"does not compile on RE2 ({_compile_error(e)}); policy regexes use RE2 syntax: "
            "no backreferences, lookahead or lookbehind, atomic groups or possessive repeats"
        )
    except (TypeError, ValueError) as e:  # e.g. a lone surrogate that cannot be UTF-8
        return f"does not compile: {e}"
    if rx.programsize > MAX_POLICY_REGEX_PROGRAM:
        return (
            f"compiles to {rx.programsize} RE2 instructions, more than the "
            f"{MAX_POLICY_REGEX_PROGRAM} a policy's regexes may use together"
        )
    return None


def program_size(pattern: str) -> int:
    """RE2 instructions of an acceptable pattern (see :func:`regex_problem`)."""
    return int(compiled(pattern).programsize)


def subject(text: str) -> bytes:
    """The UTF-8 bytes a regex leaf sees: at most REGEX_INPUT_CAP, cut before a character that
    would straddle the cap rather than split it."""
    # A lone surrogate (not valid Unicode) becomes "?" rather than failing the request.
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= REGEX_INPUT_CAP:
        return raw
    cut = REGEX_INPUT_CAP
    while cut > 0 and raw[cut] & 0xC0 == 0x80:  # raw[cut] continues the character before it
        cut -= 1
    return raw[:cut]


def search(pattern: str, capped: bytes) -> bool:
    """Whether ``pattern`` matches anywhere in ``capped`` (from :func:`subject`)."""
    return compiled(pattern).search(capped) is not None
