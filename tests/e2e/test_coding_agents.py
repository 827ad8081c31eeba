"""End to end: the coding agents users point at the box — OpenAI's Codex CLI (``codex exec``,
Responses API) and Anthropic's Claude Code (``claude -p``, Messages API) — installed from npm,
configured with nothing but a base URL and a user's API key, against ``residency up`` with a
tiny model whose template takes tools, and with one whose template takes none (the tools then
reach it in the generic format).

The tiny model's own text is random, so what it answers is scripted with the ``script_text``
fault: a plain answer (a one-turn exchange), or a call to the agent's shell tool and then a
final answer (a tool-call round trip: the agent runs the command, sends its output back, and
prints the answer). Every request goes through a recording proxy, so the tests see the second
request carry the tool's output. The agents send their full default prompts and tools (tens of
thousands of the tiny model's character-sized tokens), so the model has a large context.

npm missing skips these tests outside CI; in CI (``CI=true``) that, and any install failure,
is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from residency.tinymodel import write_tiny_model
from tests.e2e import agent_clis
from tests.e2e.agent_clis import Agents, Exchange, Recorder
from tests.e2e.test_up import Up
from tests.integration.tools_template import TOOLS_TEMPLATE

pytestmark = pytest.mark.e2e

MODEL = "t"
RUN_TIMEOUT_S = 900
ANSWER = "All done: the command printed hi."
REPLY = json.dumps({"response": ANSWER})  # the same answer in the generic tool format
# The shell command each agent is made to run: its output, and the file it leaves, show that
# the agent ran it.
COMMAND = "echo hi > hi.txt; cat hi.txt"


@pytest.fixture(scope="session")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Agents:
    in_ci = os.environ.get("CI", "").lower() == "true"
    if shutil.which("npm") is None:
        if in_ci:
            pytest.fail("npm is missing: the coding-agent tests need it in CI")
        pytest.skip("npm is missing")
    return agent_clis.install()


def agents_box(tmp: Path, models_dir: Path, template: str | None) -> Iterator[Up]:
    """``residency up`` with one tiny model (chat ``template``; None: write_tiny_model's
    plain ChatML, which takes no tools), scripted by the ``script_text`` fault."""
    kw = {} if template is None else {"chat_template": template}
    model = write_tiny_model(tmp / "model.gguf", seed=5, **kw)
    config = (
        "[debug]\nfault_injection = true\n"
        f'[models.{MODEL}]\npath = "{model}"\n'
        # The agents' prompts: ~25k (Codex) and ~43k (Claude Code) tokens of this vocabulary.
        # A cap on max_tokens bounds an answer that is not scripted.
        "n_ctx = 65536\nparallel = 1\nmax_tokens = 256\n"
    )
    b = Up(tmp, models_dir, config=config)
    yield b
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGTERM)
        b.proc.wait(60)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Up]:
    yield from agents_box(tmp_path_factory.mktemp("agents"), models_dir, TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def key(box: Up) -> str:
    return user_key(box)


def user_key(box: Up) -> str:
    """A new user's API key on ``box``: what an agent is given."""
    admin = {"Authorization": f"Bearer {box.admin_key}"}
    resp = requests.post(
        box.url + "/admin/users", json={"name": "coder"}, headers=admin, timeout=30
    )
    assert resp.status_code == 201, resp.text
    resp = requests.post(box.url + "/admin/users/coder/keys", json={}, headers=admin, timeout=30)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["key"])


def script(box: Up, *texts: str) -> None:
    resp = requests.post(
        box.url + "/admin/faults",
        json={"script_text": {MODEL: list(texts)}},
        headers={"Authorization": f"Bearer {box.admin_key}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def script_left(box: Up) -> Any:
    resp = requests.get(
        box.url + "/admin/faults",
        headers={"Authorization": f"Bearer {box.admin_key}"},
        timeout=30,
    )
    return resp.json()["faults"].get(f"script_text:{MODEL}")


def call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model's template answers one."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def posts(rec: Recorder, path: str) -> list[Exchange]:
    return [e for e in rec.exchanges if e.method == "POST" and e.path.split("?")[0] == path]


def refusals(rec: Recorder) -> list[str]:
    return [f"{e.path} {e.status}: {e.reply[:600]!r}" for e in rec.exchanges if e.status >= 400]


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    return home, work


# --- Codex ----------------------------------------------------------------------------------


def run_codex(agents: Agents, box: Up, key: str, prompt: str, tmp_path: Path) -> Any:
    home, work = dirs(tmp_path)
    with agent_clis.recording_proxy(box.url) as (url, rec):
        argv, env = agent_clis.codex_command(agents, url, key, MODEL, prompt, home, work)
        done = agent_clis.run(argv, env, work, RUN_TIMEOUT_S)
    last = home / "last-message.txt"
    return done, rec, work, last.read_text() if last.exists() else None


def test_codex_finishes_a_one_turn_exchange(
    agents: Agents, box: Up, key: str, tmp_path: Path
) -> None:
    script(box, "Hello from residency.")
    done, rec, _, last = run_codex(agents, box, key, "Say hello.", tmp_path)
    assert done.returncode == 0, (done.stderr[-3000:], refusals(rec))
    assert last is not None and last.strip() == "Hello from residency."
    (turn,) = posts(rec, "/v1/responses")
    assert turn.status == 200 and turn.body["stream"] is True


def test_codex_runs_a_shell_tool_call_round_trip(
    agents: Agents, box: Up, key: str, tmp_path: Path
) -> None:
    script(box, call("exec_command", {"cmd": COMMAND}), ANSWER)
    done, rec, work, last = run_codex(agents, box, key, "Run the command.", tmp_path)
    assert done.returncode == 0, (done.stderr[-3000:], refusals(rec))
    assert (work / "hi.txt").read_text() == "hi\n"
    first, second = posts(rec, "/v1/responses")
    assert first.status == second.status == 200
    # The second request carries the call and what running it printed.
    items = second.body["input"]
    (fc,) = [i for i in items if i.get("type") == "function_call"]
    (out,) = [i for i in items if i.get("type") == "function_call_output"]
    assert fc["name"] == "exec_command" and json.loads(fc["arguments"]) == {"cmd": COMMAND}
    assert out["call_id"] == fc["call_id"] and "hi" in str(out["output"])
    assert last is not None and last.strip() == ANSWER
    assert script_left(box) is None


# --- Claude Code ----------------------------------------------------------------------------


def run_claude(agents: Agents, box: Up, key: str, prompt: str, tmp_path: Path) -> Any:
    home, work = dirs(tmp_path)
    with agent_clis.recording_proxy(box.url) as (url, rec):
        argv, env = agent_clis.claude_command(agents, url, key, MODEL, prompt, home)
        done = agent_clis.run(argv, env, work, RUN_TIMEOUT_S)
    return done, rec, work


def test_claude_code_finishes_a_one_turn_exchange(
    agents: Agents, box: Up, key: str, tmp_path: Path
) -> None:
    script(box, "Hello from residency.")
    done, rec, _ = run_claude(agents, box, key, "Say hello.", tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:], refusals(rec))
    assert done.stdout.strip() == "Hello from residency."
    turns = posts(rec, "/v1/messages")
    assert turns and all(t.status == 200 for t in turns), refusals(rec)


def test_claude_code_runs_a_bash_tool_call_round_trip(
    agents: Agents, box: Up, key: str, tmp_path: Path
) -> None:
    script(box, call("Bash", {"command": COMMAND, "description": "Say hi"}), ANSWER)
    done, rec, work = run_claude(agents, box, key, "Run the command.", tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:], refusals(rec))
    assert (work / "hi.txt").read_text() == "hi\n"
    turns = posts(rec, "/v1/messages")
    assert len(turns) == 2 and all(t.status == 200 for t in turns), refusals(rec)
    # The second request carries the tool_use and its tool_result.
    messages = turns[1].body["messages"]
    uses = [
        b
        for m in messages
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_use"
    ]
    results = [
        b
        for m in messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]
    assert [(u["name"], u["input"]["command"]) for u in uses] == [("Bash", COMMAND)]
    assert [r["tool_use_id"] for r in results] == [uses[0]["id"]]
    assert "hi" in json.dumps(results[0]["content"])
    assert done.stdout.strip() == ANSWER
    assert script_left(box) is None


# --- a model whose template takes no tools -------------------------------------------------


@pytest.fixture(scope="module")
def plain_box(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Up]:
    """A box whose model's template takes no tools: the agents' tools reach it in the generic
    format (described in the prompt, the answer a JSON call or reply)."""
    yield from agents_box(tmp_path_factory.mktemp("agents-plain"), models_dir, None)


@pytest.fixture(scope="module")
def plain_key(plain_box: Up) -> str:
    return user_key(plain_box)


def generic_call(name: str, arguments: dict[str, Any], parallel: bool) -> str:
    """A tool call as the generic format answers one (a list when the request allows
    parallel calls, as Codex's do)."""
    call = {"name": name, "arguments": arguments}
    return json.dumps({"tool_calls": [call]} if parallel else {"tool_call": call})


def test_codex_runs_a_tool_call_on_a_model_without_tools_in_its_template(
    agents: Agents, plain_box: Up, plain_key: str, tmp_path: Path
) -> None:
    script(plain_box, generic_call("exec_command", {"cmd": COMMAND}, parallel=True), REPLY)
    done, rec, work, last = run_codex(agents, plain_box, plain_key, "Run it.", tmp_path)
    assert done.returncode == 0, (done.stderr[-3000:], refusals(rec))
    assert (work / "hi.txt").read_text() == "hi\n"
    first, second = posts(rec, "/v1/responses")
    assert first.status == second.status == 200
    (out,) = [i for i in second.body["input"] if i.get("type") == "function_call_output"]
    assert "hi" in str(out["output"])
    assert last is not None and last.strip() == ANSWER


def test_claude_code_runs_a_tool_call_on_a_model_without_tools_in_its_template(
    agents: Agents, plain_box: Up, plain_key: str, tmp_path: Path
) -> None:
    arguments = {"command": COMMAND, "description": "Say hi"}
    script(plain_box, generic_call("Bash", arguments, parallel=False), REPLY)
    done, rec, work = run_claude(agents, plain_box, plain_key, "Run it.", tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:], refusals(rec))
    assert (work / "hi.txt").read_text() == "hi\n"
    turns = posts(rec, "/v1/messages")
    assert len(turns) == 2 and all(t.status == 200 for t in turns), refusals(rec)
    assert done.stdout.strip() == ANSWER
