"""Registered models described in Ollama's shapes (``/api/tags``, ``/api/show``, ``/api/ps``):
what the registry, the model hashes and the GGUF headers say, read without loading anything.

A header is read once per file version (path, size and mtime) and kept: listing the models
does not re-read every file on every call. Only registered models' files are read (an admin
registered them), so a caller cannot point this at a file of its choosing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from typing import Any

from residency import footprint, ledger
from residency.registry import Entry
from residency.settings import reasoning_markers

#: ``general.file_type`` values as Ollama names the quantization (llama.cpp's ``LLAMA_FTYPE``).
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}
#: Header keys too large or too internal to list in ``model_info`` (the template is its own
#: field; token lists are only counted by the header reader anyway).
_SKIP_INFO = ("tokenizer.chat_template", "tokenizer.ggml.merges")
_FAR = "2262-04-11T23:47:16Z"  # Ollama's "never expires"


@functools.lru_cache(maxsize=256)
def _header(path: str, size: int, mtime_ns: int) -> footprint.Header | None:
    try:
        return footprint.read_header(path)
    except (OSError, ValueError):
        return None


def _stat(path: str | None) -> os.stat_result | None:
    if not path:
        return None
    try:
        return os.stat(path)
    except OSError:
        return None


def header(entry: Entry) -> footprint.Header | None:
    st = _stat(entry.spec.path)
    if st is None or entry.spec.path is None:
        return None
    return _header(entry.spec.path, st.st_size, st.st_mtime_ns)


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _parameter_size(h: footprint.Header | None) -> str:
    if h is None:
        return ""
    label = h.metadata.get("general.size_label")
    return str(label) if label else ""


def details(entry: Entry, h: footprint.Header | None) -> dict[str, Any]:
    if entry.spec.remote:
        return {"format": "remote", "family": "", "parameter_size": "", "quantization_level": ""}
    arch = str(h.metadata.get("general.architecture", "")) if h is not None else ""
    ftype = h.metadata.get("general.file_type") if h is not None else None
    return {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": _parameter_size(h),
        "quantization_level": FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
    }


def digest(entry: Entry, st: os.stat_result | None) -> str:
    """An identity of the registered file (its name, path, size and mtime), not a hash of its
    bytes: hashing gigabytes per listing would cost every caller the disk's time."""
    ident = f"{entry.name}\0{entry.spec.path}\0{st.st_size if st else 0}\0"
    ident += f"{st.st_mtime_ns if st else 0}\0{entry.spec.base_url or ''}"
    return hashlib.sha256(ident.encode()).hexdigest()


def tag(entry: Entry) -> dict[str, Any]:
    """One model as ``/api/tags`` lists it."""
    st = _stat(entry.spec.path)
    h = header(entry)
    return {
        "name": entry.name,
        "model": entry.name,
        "modified_at": iso(st.st_mtime if st else 0),
        "size": st.st_size if st else 0,
        "digest": digest(entry, st),
        "details": details(entry, h),
    }


def policy_tag(name: str) -> dict[str, Any]:
    """A policy is listed like a model (clients pick it by name)."""
    return {
        "name": name,
        "model": name,
        "modified_at": iso(0),
        "size": 0,
        "digest": hashlib.sha256(f"policy\0{name}".encode()).hexdigest(),
        "details": {
            "format": "policy",
            "family": "",
            "parameter_size": "",
            "quantization_level": "",
        },
    }


def _template(h: footprint.Header | None, entry: Entry) -> str:
    t = h.metadata.get("tokenizer.chat_template") if h is not None else None
    return t if isinstance(t, str) else (entry.spec.chat_format or "")


def capabilities(entry: Entry, template: str) -> list[str]:
    """What the model serves, as Ollama names it."""
    if entry.spec.type == "embedding":
        return ["embedding"]
    if entry.spec.type != "llm":
        return [entry.spec.type]
    caps = ["completion"]
    if entry.spec.remote or "tools" in template:
        caps.append("tools")
    if entry.spec.mmproj:
        caps.append("vision")
    markers = reasoning_markers(entry.spec.reasoning) if entry.spec.reasoning != "none" else None
    thinks = entry.spec.reasoning != "none" and (
        markers is not None or any(m in template for m in ("<think>", "[THINK]", "enable_thinking"))
    )
    if thinks:
        caps.append("thinking")
    return caps


def show(entry: Entry) -> dict[str, Any]:
    """``/api/show``'s answer for one model."""
    h = header(entry)
    template = _template(h, entry)
    info: dict[str, Any] = {}
    if h is not None:
        info = {
            k: v
            for k, v in h.metadata.items()
            if not k.startswith(_SKIP_INFO) and not (isinstance(v, str) and len(v) > 1024)
        }
    st = _stat(entry.spec.path)
    return {
        "license": str(h.metadata.get("general.license", "")) if h is not None else "",
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": details(entry, h),
        "model_info": info,
        "capabilities": capabilities(entry, template),
        "modified_at": iso(st.st_mtime if st else 0),
    }


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def running(entry: Entry, fields: dict[str, str], now: float) -> dict[str, Any]:
    """One resident model as ``/api/ps`` lists it: its bytes in the memory ledger (the
    footprint measured at its load, else the estimate), and when its ``ttl_s`` would expire
    it if it stays idle (never, without one)."""
    size = _int(fields.get("footprint_bytes")) or _int(fields.get("estimate_bytes"))
    device = fields.get("device") or "cpu"
    ttl = entry.spec.ttl_s
    if ttl and not entry.spec.pinned:
        last = float(fields.get("last_used") or now)
        expires = iso(last + ttl)
    else:
        expires = _FAR
    st = _stat(entry.spec.path)
    return {
        "name": entry.name,
        "model": entry.name,
        "size": size,
        "digest": digest(entry, st),
        "details": details(entry, header(entry)),
        "expires_at": expires,
        "size_vram": 0 if ledger.is_cpu(device) else size,
        "context_length": entry.spec.n_ctx,
    }
