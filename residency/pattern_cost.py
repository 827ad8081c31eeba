"""What a JSON-schema ``pattern`` costs the sampling grammar (pure).

llama.cpp's converter writes a bounded repeat ``x{n,m}`` out as ``m`` nested copies of ``x``.
A repeat inside a repeat then gives a grammar in which one prefix of text can sit at many
places at once: after a few characters of ``^((a|b){0,100}){0,100}$`` the parser tracks every
way of splitting them between the outer and the inner copies, and checking one token against
the grammar walks all of them (measured: seconds a token after ~20 characters on a 400-token
vocabulary, where a flat ``^a{0,256}$`` takes milliseconds for the whole answer).

``nesting`` is the product of the repeat counts along the most deeply nested chain of repeats
(side by side parts and alternatives take the largest, not the sum): a bound on how many
places the parser can be in at once because of repeats. Loops (``*``, ``+``) are not written
out and count once; ``?`` counts once.
"""

from __future__ import annotations

import re

_QUANT = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")


def nesting(body: str, cap: int) -> int:
    """The repeat product of a pattern ``body`` (without its ``^``/``$``), or ``cap + 1`` once
    it passes ``cap`` (the walk stops there: a hostile pattern's product can have thousands of
    digits). Iterative: a group nests as deep as the pattern is long."""
    # Per open group: the largest product among its finished alternatives, among the finished
    # parts of its current alternative, and that of the part before the cursor (which a
    # quantifier that follows multiplies).
    frames: list[list[int]] = [[1, 1, 1]]
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        top = frames[-1]
        if c == "(":
            frames.append([1, 1, 1])
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            frames.pop()
            done = max(top)
            parent = frames[-1]
            parent[1] = max(parent[1], parent[2])
            parent[2] = done
            i += 1
            continue
        if c == "|":
            top[0] = max(top)
            top[1] = top[2] = 1
            i += 1
            continue
        times = _times(body, i)
        if times is not None:
            k, i = times
            top[2] = min(top[2] * k, cap + 1)
            if top[2] > cap:
                return cap + 1
            continue
        if c in "*+?":
            i += 1
            continue
        # An atom: a class, an escape, '.' or a character.
        top[1] = max(top[1], top[2])
        top[2] = 1
        i = _atom_end(body, i)
    while len(frames) > 1:  # unbalanced: the converter refuses it later; count what is there
        done = max(frames.pop())
        frames[-1][2] = max(frames[-1][2], done)
    return max(frames[0])


def _times(body: str, i: int) -> tuple[int, int] | None:
    """The most times a ``{...}`` quantifier at ``i`` repeats its atom, and where it ends."""
    m = _QUANT.match(body, i)
    if m is None or not (m[1] or m[3]):
        return None
    lo, comma, hi = m[1], m[2], m[3]
    if max(len(lo), len(hi or "")) > 9:
        return 10**9, m.end()  # more than any cap; int() refuses thousands of digits
    if comma is None:
        most = int(lo)
    elif hi:
        most = int(hi)
    else:
        most = int(lo or 0) + 1  # {n,}: n copies, then a loop
    return max(most, 1), m.end()


def _atom_end(body: str, i: int) -> int:
    if body[i] == "\\":
        return i + 2
    if body[i] == "[":
        j = i + 1
        while j < len(body) and body[j] != "]":
            j += 2 if body[j] == "\\" else 1
        return j + 1
    return i + 1
