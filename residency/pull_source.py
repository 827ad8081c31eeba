"""What a pull's source resolves to: the file's URL, name, size and checksum.

A hub source is asked of the hub once, through ``huggingface_hub`` (``HF_ENDPOINT`` and
``HF_TOKEN`` honoured, read at each call): the repository's files with their LFS metadata, at
one commit, so the file downloaded is the file whose size and sha256 were read. A plain URL is
taken as given (its size comes from the agent's request; its checksum only from
``#sha256=``).
"""

from __future__ import annotations

import os
from typing import Any

from residency.pulls import Source, SourceError, local_file_name, pick_file, pick_projector

#: Seconds the admin API waits for the hub's answer about a repository.
HUB_TIMEOUT_S = 20.0
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubUnreachable(RuntimeError):
    """The hub did not answer (or answered with an error that is not about the source)."""


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def auth_headers(url: str) -> dict[str, str]:
    """The hub's token, sent only to the hub itself (never to a plain URL's server)."""
    tok = token()
    if tok and url.startswith(endpoint() + "/"):
        return {"Authorization": f"Bearer {tok}"}
    return {}


def resolve(src: Source, mmproj: bool) -> dict[str, Any]:
    """The record fields of a pull of ``src``: ``file`` (the local name), ``url``, ``size``,
    ``sha256`` (None where unknown), and ``mmproj_*`` for a projector."""
    if src.kind == "url":
        if mmproj:
            raise SourceError("'mmproj' needs an hf: source (the projector is found beside it)")
        return {"file": local_file_name(src.url), "url": src.url, "sha256": src.sha256}
    from huggingface_hub import HfApi, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    api = HfApi(endpoint=endpoint(), token=token() or False)
    try:
        info = api.model_info(src.repo, files_metadata=True, timeout=HUB_TIMEOUT_S)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as e:
        raise SourceError(f"hf:{src.repo}: {e.__class__.__name__}: not found or not allowed") from e
    except (HfHubHTTPError, EntryNotFoundError, OSError) as e:
        raise HubUnreachable(f"the hub at {endpoint()} failed: {e}") from e
    siblings = {s.rfilename: s for s in info.siblings or []}
    rev = info.sha or "main"

    def fields(path: str, prefix: str = "") -> dict[str, Any]:
        s = siblings[path]
        lfs = s.lfs
        return {
            f"{prefix}file": local_file_name(path),
            f"{prefix}url": hf_hub_url(src.repo, path, revision=rev, endpoint=endpoint()),
            f"{prefix}size": (lfs.size if lfs else s.size),
            f"{prefix}sha256": (lfs.sha256 if lfs else None),
        }

    names = list(siblings)
    out = fields(pick_file(names, src.selector, src.repo))
    if mmproj:
        out.update(fields(pick_projector(names, src.repo), "mmproj_"))
    return out
