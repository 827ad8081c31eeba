"""docs/configuration.md's key table is the settings' definition, kept in step by this test."""

from __future__ import annotations

import json
import re
from pathlib import Path

from residency.settings import key_meta

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def doc_rows() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    table = text[text.index("<!-- keys:begin") : text.index("<!-- keys:end -->")]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `([a-z_.]+)` \| `([^`]*)` \| [^|]* \| (\w[\w-]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_every_key_is_documented_with_its_default_and_when_it_applies() -> None:
    expected = {k: (json.dumps(m["default"]), m["applies"]) for k, m in key_meta().items()}
    assert doc_rows() == expected
