"""System messages a chat handler cannot render where they stand, folded into user turns (pure:
no llama.cpp).

Several of llama-cpp-python's chat formats drop system messages without a word: ``gemma``
drops every one (Gemma's templates have no system role), most others keep only the first
(``_get_system_message``) and drop a second leading one or one sent after other turns, and a
few ignore it for a fixed preamble (``vicuna``, ``phind``...). A GGUF template may refuse a
system message after other turns instead (Gemma 3's: "roles must alternate"). The model process
probes its loaded handler once (``workers.runtime``) and records what it renders in
``SystemRoles``; ``fold`` then rewrites each request's messages so every system text reaches
the prompt:

* leading system messages the handler cannot render become the head of the first user turn:
  their text and a blank line before its content, as Gemma's own GGUF template does; several
  leading ones where it renders only one are joined into one;
* a system (or developer) message after other turns that the handler would drop or refuse
  joins the user turn next to it (the one after it, else the one before it), or becomes a user
  turn of its own between two assistant turns: it stays where it was sent, so the prompt's
  earlier part, and the slot cache that holds it, are unchanged;
* where the handler renders not even a user turn's text as given (a probe that failed), no
  fold is trusted: a system message it would not render is refused with 400 naming
  ``messages[i].role`` rather than dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from residency.errors import ApiError

SYSTEM_ROLES = ("system", "developer")
#: Between folded system text and the user text it heads (Gemma's GGUF template's own).
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class SystemRoles:
    """What one chat handler renders. ``leading``: a system message before the first other
    turn; ``several``: more than one of those; ``later``: one after other turns (with a
    leading one also there); ``folds``: a user turn's text as given (False: nothing can be
    folded into it)."""

    leading: bool = True
    several: bool = True
    later: bool = True
    folds: bool = True

    @property
    def complete(self) -> bool:
        return self.leading and self.several and self.later


#: A handler that renders every system message (no rewriting).
ALL = SystemRoles()


def _is_system(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") in SYSTEM_ROLES


def text_of(content: Any) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _prepend(user: dict[str, Any], text: str) -> dict[str, Any]:
    content = user.get("content")
    if isinstance(content, list):
        return {**user, "content": [{"type": "text", "text": text + SEPARATOR}, *content]}
    return {**user, "content": text + SEPARATOR + (content or "")}


def _append(user: dict[str, Any], text: str) -> dict[str, Any]:
    content = user.get("content")
    if isinstance(content, list):
        return {**user, "content": [*content, {"type": "text", "text": SEPARATOR + text}]}
    return {**user, "content": (content or "") + SEPARATOR + text}


def _refuse(i: int, where: str) -> ApiError:
    return ApiError(
        400,
        f"this model's chat template cannot take a system message {where}, and it could not "
        f"be folded into a user turn; send its text in a user message",
        param=f"messages[{i}].role",
        code="invalid_messages",
    )


def _leading(messages: Sequence[Any]) -> int:
    """How many system messages the conversation opens with."""
    n = 0
    while n < len(messages) and _is_system(messages[n]):
        n += 1
    return n


def fold(messages: Sequence[Any], roles: SystemRoles) -> list[Any]:
    """``messages`` with every system text where the handler renders it (see the module
    docstring). Raises the client's 400 for a system message that can be neither rendered
    nor folded."""
    # OpenAI's newer name for the role: templates know only "system" (web renames it too).
    messages = [
        {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
        for m in messages
    ]
    if roles.complete or not any(_is_system(m) for m in messages):
        return messages
    n = _leading(messages)
    out: list[Any] = []
    carry = ""  # leading system text that heads the first user turn
    if n and roles.leading:
        if n == 1 or roles.several:
            out.extend(messages[:n])
        else:  # several, where the handler renders only the first: one of them all
            texts = (text_of(m.get("content")) for m in messages[:n])
            out.append({"role": "system", "content": _join(texts)})
    elif n:
        if not roles.folds:
            raise _refuse(0, "at the start of the conversation")
        carry = _join(text_of(m.get("content")) for m in messages[:n])
    pending: list[str] = []  # later system texts waiting for the next user turn
    for i in range(n, len(messages)):
        m = messages[i]
        if _is_system(m):
            if roles.later:
                out.append(m)
            elif not roles.folds:
                raise _refuse(i, "after other turns")
            elif text := text_of(m.get("content")):
                pending.append(text)
            continue
        if isinstance(m, dict) and m.get("role") == "user":
            if carry:
                m, carry = _prepend(m, carry), ""
            if pending:
                m, pending = _prepend(m, _join(pending)), []
        else:
            if carry:
                # No user turn before this one to carry it: the text is a user turn itself.
                out.append({"role": "user", "content": carry})
                carry = ""
            if pending:
                # Between other turns (an assistant's, a tool's): the user turn just before
                # takes it, else it is a user turn of its own.
                out = _attach(out, _join(pending))
                pending = []
        out.append(m)
    if carry:
        out.append({"role": "user", "content": carry})
    if pending:
        out = _attach(out, _join(pending))
    return out


def _join(texts: Iterable[str]) -> str:
    return SEPARATOR.join(t for t in texts if t)


def _attach(out: list[Any], text: str) -> list[Any]:
    """``text`` after the turns in ``out``: appended to the last one when it is a user turn,
    else as a user turn of its own."""
    if out and isinstance(out[-1], dict) and out[-1].get("role") == "user":
        return [*out[:-1], _append(out[-1], text)]
    return [*out, {"role": "user", "content": text}]


def shared_head(messages: Sequence[Any], roles: SystemRoles) -> list[Any]:
    """The messages whose rendering begins the prompt's system part (its leading system
    messages, as ``fold`` places them), for the cache's shareable prefix: the system messages
    alone where the handler renders them, else the first user turn holding only the folded
    system text (its rendering then shares the prompt's tokens up to that text). Empty: none."""
    n = _leading(messages)
    if n == 0:
        return []
    if roles.leading:
        return fold(list(messages[:n]), roles)
    if not roles.folds:
        return []
    text = _join(text_of(m.get("content")) for m in messages[:n])
    return [{"role": "user", "content": text + SEPARATOR}] if text else []
