"""Pulls: the pure decisions of fetching a model file onto a host (``residency pull``).

No Redis, no network: what a source names, which of a repository's files it means, whether a
file fits on a disk, what a GGUF header makes of the model, and the states a pull goes through.
The effects live in ``residency.pull_store`` (records and queues in Redis),
``residency.pull_source`` (asking the hub) and ``workers.pull`` (the download, in the agent).
"""

from __future__ import annotations

import enum
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from residency.footprint import ENCODER_ARCHS, Header
from residency.settings import MODEL_NAME_RE


class PullState(enum.StrEnum):
    QUEUED = "queued"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


P = PullState

TRANSITIONS: dict[PullState, frozenset[PullState]] = {
    # The agent takes it; an admin cancels it before it starts; the agent finds it unworkable.
    P.QUEUED: frozenset({P.DOWNLOADING, P.CANCELLED, P.FAILED}),
    # Bytes arrive until the file is whole (verifying), the download fails or is cancelled, or
    # the agent restarts and queues it again (its partial file is resumed).
    P.DOWNLOADING: frozenset({P.VERIFYING, P.FAILED, P.CANCELLED, P.QUEUED}),
    # Checksum, header and registration: done, or failed with nothing registered.
    P.VERIFYING: frozenset({P.DONE, P.FAILED, P.CANCELLED, P.QUEUED}),
    P.DONE: frozenset(),
    P.FAILED: frozenset(),
    P.CANCELLED: frozenset(),
}

#: States a pull never leaves.
FINISHED: frozenset[PullState] = frozenset({P.DONE, P.FAILED, P.CANCELLED})
#: States that hold a place in their host's queue.
PENDING: frozenset[PullState] = frozenset(set(PullState) - FINISHED)


def can_transition(src: PullState, dst: PullState) -> bool:
    return dst in TRANSITIONS[src]


def sources_for(dst: PullState) -> frozenset[PullState]:
    return frozenset(src for src, dsts in TRANSITIONS.items() if dst in dsts)


class SourceError(ValueError):
    """A source that names nothing pullable; the message says why (and lists the choices)."""

    def __init__(self, message: str, choices: list[str] | None = None) -> None:
        super().__init__(message)
        self.choices = choices or []


_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_SHA_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_MAX_SOURCE = 2048


@dataclass(frozen=True)
class Source:
    """A parsed source: a hub repository (``repo``, with an optional quant or file
    ``selector``) or a plain URL (``url``, with an optional ``sha256`` from its fragment)."""

    kind: str  # "hf" | "url"
    repo: str = ""
    selector: str | None = None
    url: str = ""
    sha256: str | None = None


def parse_source(text: str) -> Source:
    """``hf:ORG/REPO[:QUANT or FILE]`` or an ``http(s)://…gguf`` URL (``#sha256=HEX`` pins its
    checksum)."""
    if not isinstance(text, str) or not text or len(text) > _MAX_SOURCE:
        raise SourceError(f"'source' must be a string of 1 to {_MAX_SOURCE} characters")
    if text.startswith("hf:"):
        repo, _, selector = text[3:].partition(":")
        if not _REPO_RE.match(repo) or ".." in repo:
            raise SourceError(f"{text!r}: expected hf:ORG/REPO[:QUANT or FILE]")
        if selector and (selector.startswith("/") or ".." in selector.split("/")):
            raise SourceError(f"{text!r}: the file must be a path inside the repository")
        return Source("hf", repo=repo, selector=selector or None)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError(f"{text!r}: expected hf:ORG/REPO[:QUANT or FILE] or an http(s) URL")
    if not parts.path.lower().endswith(".gguf"):
        raise SourceError(f"{text!r}: the URL's path must end with .gguf")
    sha = None
    if parts.fragment:
        k, _, v = parts.fragment.partition("=")
        if k != "sha256" or not _SHA_RE.match(v):
            raise SourceError(f"{text!r}: the only fragment understood is #sha256=<64 hex digits>")
        sha = v.lower()
    return Source("url", url=urllib.parse.urlunsplit(parts._replace(fragment="")), sha256=sha)


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def is_projector(path: str) -> bool:
    return _base(path).lower().startswith("mmproj") and path.lower().endswith(".gguf")


def model_files(files: list[str]) -> list[str]:
    """The repository's model GGUFs (its vision projectors excluded), sorted."""
    return sorted(f for f in files if f.lower().endswith(".gguf") and not is_projector(f))


def pick_file(files: list[str], selector: str | None, repo: str) -> str:
    """The one GGUF of ``files`` the selector means: a file named exactly (with or without its
    folder), the one whose name holds the quant (case-insensitive), or the only one."""
    ggufs = model_files(files)
    if not ggufs:
        raise SourceError(f"{repo} holds no .gguf model file")
    if selector is None:
        if len(ggufs) == 1:
            return ggufs[0]
        raise SourceError(
            f"{repo} holds {len(ggufs)} GGUF files: name one as hf:{repo}:QUANT or hf:{repo}:FILE",
            ggufs,
        )
    if selector.lower().endswith(".gguf"):
        exact = [f for f in files if f == selector] or [f for f in ggufs if _base(f) == selector]
        if len(exact) == 1:
            return exact[0]
        raise SourceError(f"{repo} has no file {selector!r}", ggufs)
    hits = [f for f in ggufs if selector.lower() in _base(f).lower()]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise SourceError(f"{repo} has no GGUF file whose name holds {selector!r}", ggufs)
    raise SourceError(f"{len(hits)} GGUF files of {repo} match {selector!r}: name one", hits)


def pick_projector(files: list[str], repo: str) -> str:
    """The repository's vision projector: the only ``mmproj*.gguf``, or of several the f16 one
    (the precision llama.cpp's own conversions publish), else an error listing them."""
    projs = sorted(f for f in files if is_projector(f))
    if len(projs) == 1:
        return projs[0]
    if not projs:
        raise SourceError(f"{repo} holds no mmproj*.gguf vision projector")
    f16 = [f for f in projs if "f16" in _base(f).lower()]
    if len(f16) == 1:
        return f16[0]
    raise SourceError(f"{repo} holds {len(projs)} projectors: pull one by URL", projs)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def local_file_name(path_or_url: str) -> str:
    """The name a downloaded file is stored under: the last part of its path, reduced to
    letters, digits, ``._-`` (never a folder, never hidden: a hub or URL name cannot place a
    file anywhere but the target folder)."""
    base = urllib.parse.unquote(_base(urllib.parse.urlsplit(path_or_url).path or path_or_url))
    name = _UNSAFE.sub("-", base).lstrip(".-") or "model.gguf"
    if not name.lower().endswith(".gguf"):
        name += ".gguf"
    return name[-200:]


def default_model_name(file_name: str) -> str:
    """A registry name from a file name: its stem, made a valid model name."""
    stem = file_name[:-5] if file_name.lower().endswith(".gguf") else file_name
    name = re.sub(r"[^A-Za-z0-9._:-]+", "-", stem).lstrip("._:-")[:128] or "model"
    assert MODEL_NAME_RE.match(name)
    return name


def fits(free_bytes: int, needed_bytes: int, reserve_bytes: int) -> bool:
    """Whether ``needed_bytes`` more can be written and still leave ``reserve_bytes`` free."""
    return needed_bytes + reserve_bytes <= free_bytes


#: The context a pulled model is registered with, at most (its trained context may be larger).
DEFAULT_N_CTX = 4096
_MIN_N_CTX = 16
#: llama.cpp's pooling types (``{arch}.pooling_type``): 1 mean, 2 cls, 3 last, 4 rank.
_RANK_POOLING = 4


def model_facts(h: Header) -> dict[str, Any]:
    """What a model is registered with, from its header: ``type`` (a ``rank`` pooling or a
    classifier head: rerank; another pooling or an encoder architecture: embedding; else
    llm) and ``n_ctx`` (its trained context, at most ``DEFAULT_N_CTX``)."""
    pooling = h.arch_key("pooling_type")
    if pooling == _RANK_POOLING or h.array_lengths.get(f"{h.arch}.classifier.output_labels"):
        kind = "rerank"
    elif (pooling is not None and int(pooling) > 0) or h.arch in ENCODER_ARCHS:
        kind = "embedding"
    else:
        kind = "llm"
    trained = h.arch_key("context_length")
    n_ctx = DEFAULT_N_CTX if not trained else max(_MIN_N_CTX, min(int(trained), DEFAULT_N_CTX))
    return {"type": kind, "n_ctx": n_ctx}
