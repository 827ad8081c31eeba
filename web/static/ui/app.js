// The residency dashboard: reads /health, the admin API and /metrics every few seconds and edits
// the live settings with PATCH /admin/config. No libraries and no build step. Server data is
// only ever set as text (never as HTML): the admin key sits in sessionStorage.
"use strict";

(() => {
  const REFRESH_MS = 3000;
  const USAGE_DAYS = 14;
  const TOKEN = "residency.adminKey";
  const RESIDENT = new Set(["loading", "ready", "draining"]);
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  let timer = null;
  let refreshing = false;
  let again = false; // a refresh was asked for while one ran: run another when it ends
  let savedGeneration = 0; // the generation of our last saved change
  let schema = null; // settings.json: key -> {default, applies, doc}

  // --- small helpers ---------------------------------------------------------------------

  function el(tag, attrs = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "text") e.textContent = v;
      else if (v !== null && v !== undefined) e.setAttribute(k, v);
    }
    e.append(...children);
    return e;
  }

  const cell = (field, text) => el("td", { "data-field": field, text: String(text) });

  function ago(epochSeconds) {
    if (!epochSeconds) return "—";
    const s = Math.max(0, Date.now() / 1000 - epochSeconds);
    if (s < 90) return `${Math.round(s)} s ago`;
    if (s < 5400) return `${Math.round(s / 60)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }

  function duration(seconds) {
    if (seconds < 90) return `${seconds.toFixed(1)} s`;
    if (seconds < 5400) return `${(seconds / 60).toFixed(1)} min`;
    return `${(seconds / 3600).toFixed(1)} h`;
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  async function call(method, path, body) {
    const headers = { Authorization: `Bearer ${sessionStorage.getItem(TOKEN) || ""}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const resp = await fetch(path, {
      method, headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (resp.status === 401 && path.startsWith("/admin/")) {
      signOut("The admin key was refused; sign in again.");
      throw new Error("admin key refused");
    }
    return resp;
  }

  async function json(resp) {
    try { return await resp.json(); } catch { return {}; }
  }

  // --- sign in / out ---------------------------------------------------------------------

  async function signIn(ev) {
    ev.preventDefault();
    const token = $("token").value.trim();
    $("sign-in-error").textContent = "";
    let resp;
    try {
      resp = await fetch("/admin/config", { headers: { Authorization: `Bearer ${token}` } });
    } catch (e) {
      $("sign-in-error").textContent = `The box did not answer: ${e.message}`;
      return;
    }
    if (!resp.ok) {
      $("sign-in-error").textContent = resp.status === 401
        ? "That admin key was refused." : `Sign-in failed: HTTP ${resp.status}`;
      return;
    }
    sessionStorage.setItem(TOKEN, token);
    $("token").value = "";
    start();
  }

  function signOut(message) {
    sessionStorage.removeItem(TOKEN);
    clearInterval(timer);
    timer = null;
    $("dashboard").hidden = true;
    $("sign-out").hidden = true;
    $("sign-in-form").hidden = false;
    for (const id of ["settings", "audit", "usage-chart"]) $(id).replaceChildren();
    for (const t of ["models", "limits", "loads", "evictions"]) $(t).tBodies[0].replaceChildren();
    $("status").textContent = "";
    $("sign-in-error").textContent = message || "";
  }

  async function start() {
    $("sign-in-form").hidden = true;
    $("dashboard").hidden = false;
    $("sign-out").hidden = false;
    if (!schema) {
      const resp = await fetch("/admin/ui/settings.json", { cache: "no-store" });
      schema = (await json(resp)).keys || {};
    }
    await refresh();
    if (sessionStorage.getItem(TOKEN) && !timer) timer = setInterval(refresh, REFRESH_MS);
  }

  // --- refresh: each section on its own, so one failing leaves the others current ----------

  async function refresh() {
    if (!sessionStorage.getItem(TOKEN)) return;
    if (refreshing) { again = true; return; }
    refreshing = true;
    try {
      const [health] = await Promise.allSettled([
        section("/health", (r) => json(r).then(renderHealth), true),
        section("/admin/config", (r) => json(r).then(renderConfig)),
        section("/admin/audit?limit=20", (r) => json(r).then(renderAudit)),
        section("/metrics", (r) => r.text().then(renderMetrics)),
        call("GET", usagePath()).then(renderUsage, () => renderUsage(null)),
      ]);
      if (health.status === "rejected" && sessionStorage.getItem(TOKEN)) {
        $("status").textContent = `No answer from the box at ${new Date().toLocaleTimeString()}.`;
      }
    } finally {
      refreshing = false;
    }
    if (again) { again = false; await refresh(); }
  }

  // /health answers 503 with a body while the box starts: that body is still worth showing.
  async function section(path, render, acceptUnavailable = false) {
    const resp = await call("GET", path);
    if (resp.ok || (acceptUnavailable && resp.status === 503)) return render(resp);
    $("status").textContent = `${path}: HTTP ${resp.status}`;
  }

  // --- the pool and its limits -----------------------------------------------------------

  function renderHealth(h) {
    if (!h.models) {
      $("status").textContent = `The box is ${h.status || "not answering"}.`;
      return;
    }
    const err = h.config_error ? ` · config error: ${h.config_error}` : "";
    $("status").textContent =
      `Generation ${h.generation} · published ${ago(h.published_at)} · ` +
      `updated ${new Date().toLocaleTimeString()}${err}`;
    const memory = {};
    for (const w of h.workers || []) memory[w.host] = w.memory_used || {};
    $("models").tBodies[0].replaceChildren(...h.models.map((m) => modelRow(m, memory)));
    renderLimits(h);
    renderPulls(h.pulls || []);
    renderRouting(h.routing || {});
  }

  function renderRouting(routing) {
    $("routing").tBodies[0].replaceChildren(...Object.entries(routing).map(([name, p]) => {
      const choices = Object.entries(p.choices || {}).map(([c, n]) => `${c} ${n}`).join(", ");
      const e = p.error;
      const error = e ? `${Math.round(e.median_rel * 100)}% (${e.median_abs_s.toFixed(3)} s)` : "—";
      const off = p.off ? `${p.off.term} (${Math.round(p.off.median_rel * 100)}%)` : "—";
      return el("tr", { "data-policy": name },
        el("th", { scope: "row", text: name }),
        el("td", { "data-field": "choices", text: choices || "—" }),
        el("td", { "data-field": "samples", text: String(p.samples || 0) }),
        el("td", { "data-field": "error", text: error }),
        el("td", { "data-field": "off", text: off }));
    }));
  }

  function renderPulls(pulls) {
    $("pulls").tBodies[0].replaceChildren(...pulls.map((p) => {
      const done = p.bytes_done || 0;
      const progress = p.bytes_total
        ? el("progress", { max: String(p.bytes_total), value: String(done),
          title: `${bytes(done)} of ${bytes(p.bytes_total)}` })
        : bytes(done);
      const state = p.error && p.state !== "done" ? `${p.state} (${p.error})` : p.state;
      return el("tr", {}, el("td", {}, p.source), el("td", {}, p.host || "-"),
        el("td", {}, p.name || "-"), el("td", {}, state), el("td", {}, progress));
    }));
  }

  function modelRow(m, memory) {
    let state = m.state;
    if (m.error) state += ` (${m.error})`;
    if (m.backoff) state += ` · backoff until ${new Date(m.backoff.until * 1000).toLocaleTimeString()}`;
    const slots = m.slots ? `${m.in_flight} / ${m.slots.parallel}` : String(m.in_flight);
    let queued = String(m.queued);
    if (m.queued_by_user && Object.keys(m.queued_by_user).length) {
      const who = Object.entries(m.queued_by_user).map(([u, n]) => `${u} ${n}`).join(", ");
      queued += ` (${who})`;
    }
    const where = m.host ? `${m.host} / ${m.device || "—"}` : "—";
    let mem = "—";
    if (typeof m.memory === "number") mem = bytes(m.memory);
    else if (m.host && m.device && typeof (memory[m.host] || {})[m.device] === "number") {
      mem = `${m.device}: ${Math.round(memory[m.host][m.device] * 100)}% in use`;
    }
    const yielding = m.yielding ? `to ${m.yielding.for}, ${ago(m.yielding.since)}` : "no";
    return el("tr", { "data-model": m.name, "data-state": m.state },
      el("th", { scope: "row", "data-field": "name", text: m.name }),
      cell("type", m.pool === "standard" ? m.type : `${m.type} (${m.pool})`),
      cell("state", state),
      cell("busy", m.busy ? "busy" : "idle"),
      cell("in_flight", slots),
      cell("queued", queued),
      cell("pinned", m.pinned ? "pinned" : "no"),
      cell("where", where),
      cell("memory", mem),
      cell("yielding", yielding));
  }

  function renderLimits(h) {
    const blocked = (h.enforcement || {}).blocked || {};
    const rows = Object.entries(h.max_models || {}).map(([type, lim]) => {
      const resident = h.models.filter(
        (m) => m.type === type && m.pool === "standard" && RESIDENT.has(m.state)).length;
      const unlimited = (n) => (n < 0 ? "unlimited" : String(n));
      return el("tr", { "data-type": type },
        el("th", { scope: "row", text: type }),
        cell("configured", unlimited(lim.configured)),
        cell("effective", unlimited(lim.effective)),
        cell("resident", resident),
        cell("blocked", blocked[type] || 0));
    });
    $("limits").tBodies[0].replaceChildren(...rows);
    const auto = h.llm_pool_autosize || {};
    $("autosize-advisory").textContent = auto.advisory ||
      (auto.enabled ? `LLM autosize on: the policies' candidate floor is ${auto.candidate_floor}.`
        : "LLM autosize off.");
  }

  // --- loads, evictions and admin actions -------------------------------------------------

  function parseMetrics(text) {
    const out = [];
    for (const line of text.split("\n")) {
      const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
      out.push({ name: m[1], labels, value: Number(m[3]) });
    }
    return out;
  }

  function renderMetrics(text) {
    const models = {};
    const reasons = {};
    const get = (name) => (models[name] ||= { ok: 0, error: 0, ageSum: 0, ageCount: 0 });
    for (const s of parseMetrics(text)) {
      if (s.name === "residency_model_loads_total") {
        get(s.labels.model)[s.labels.outcome === "ok" ? "ok" : "error"] += s.value;
      } else if (s.name === "residency_evictions_total") {
        reasons[s.labels.reason] = (reasons[s.labels.reason] || 0) + s.value;
      } else if (s.name === "residency_age_at_eviction_seconds_sum") {
        get(s.labels.model).ageSum += s.value;
      } else if (s.name === "residency_age_at_eviction_seconds_count") {
        get(s.labels.model).ageCount += s.value;
      }
    }
    $("loads").tBodies[0].replaceChildren(...Object.keys(models).sort().map((name) => {
      const m = models[name];
      const age = m.ageCount ? `${duration(m.ageSum / m.ageCount)} (${m.ageCount} evicted)` : "—";
      return el("tr", { "data-model": name },
        el("th", { scope: "row", text: name }),
        cell("ok", m.ok), cell("error", m.error), cell("age", age));
    }));
    $("evictions").tBodies[0].replaceChildren(...Object.keys(reasons).sort().map((r) =>
      el("tr", { "data-reason": r }, el("th", { scope: "row", text: r }), cell("count", reasons[r]))));
  }

  function renderAudit(a) {
    $("audit").replaceChildren(...(a.audit || []).map((rec) => el("li", {
      "data-action": rec.action,
      text: `${new Date(rec.at * 1000).toLocaleString()} · ${rec.actor} · ${rec.action} · ` +
        JSON.stringify(rec.detail),
    })));
  }

  // --- usage ------------------------------------------------------------------------------

  // The last USAGE_DAYS UTC days, today included, as GET /admin/usage takes them.
  function usagePath() {
    const day = (msAgo) => new Date(Date.now() - msAgo).toISOString().slice(0, 10);
    return `/admin/usage?from=${day((USAGE_DAYS - 1) * 86400000)}&to=${day(0)}`;
  }

  async function renderUsage(resp) {
    const status = $("usage-status");
    if (!resp || !resp.ok) {
      status.textContent = resp && resp.status === 404
        ? "Usage: not available on this box."
        : `Usage: not available (${resp ? `HTTP ${resp.status}` : "no answer"}).`;
      $("usage-chart").replaceChildren();
      return;
    }
    const body = await json(resp);
    // `days`: every day of the range (zeros included), with the day's totals.
    const days = Object.entries(body.days || {}).sort()
      .map(([day, t]) => ({ day, requests: t.requests || 0, tokens: t.total_tokens || 0 }));
    const total = body.total || {};
    status.textContent = `Requests per day, ${body.from} to ${body.to}: ` +
      `${total.requests || 0} requests, ${total.total_tokens || 0} tokens in all ` +
      "(a bar's tooltip has its tokens).";
    $("usage-chart").replaceChildren(days.length ? barChart(days) : "");
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    return e;
  }

  function barChart(days) {
    const bar = 28, gap = 6, height = 140, top = 16, bottom = 20;
    const max = Math.max(1, ...days.map((d) => d.requests));
    const width = days.length * (bar + gap) + gap;
    const chart = svg("svg", {
      width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": `Requests per day, ${days[0].day} to ${days[days.length - 1].day}`,
    });
    days.forEach((d, i) => {
      const h = Math.round((d.requests / max) * (height - top - bottom));
      const x = gap + i * (bar + gap);
      const g = svg("g", { "data-day": d.day });
      const title = svg("title", {});
      title.textContent = `${d.day}: requests ${d.requests}, tokens ${d.tokens}`;
      const label = svg("text", { x: x + bar / 2, y: height - 6, "text-anchor": "middle" });
      label.textContent = d.day.slice(5);
      const value = svg("text", { x: x + bar / 2, y: height - bottom - h - 4, "text-anchor": "middle" });
      value.textContent = String(d.requests);
      g.append(title, svg("rect", { x, y: height - bottom - h, width: bar, height: h }), label, value);
      chart.append(g);
    });
    return chart;
  }

  // --- live settings ----------------------------------------------------------------------

  function renderConfig(c) {
    // An answer read before our last save landed would put the old values back.
    if ((c.generation || 0) < savedGeneration) return;
    const body = $("settings");
    for (const [key, meta] of Object.entries(schema || {})) {
      if (meta.applies !== "live") continue;
      const [sect, name] = [key.slice(0, key.indexOf(".")), key.slice(key.indexOf(".") + 1)];
      const value = (c.config[sect] || {})[name];
      let input = $(`setting-${key}`);
      if (!input) {
        input = settingRow(body, key, meta, value);
      }
      input.dataset.server = JSON.stringify(value);
      // Never overwrite what the admin is typing: only untouched fields follow the box.
      if (!input.dataset.dirty && document.activeElement !== input) showValue(input, value);
      $(`source-${key}`).textContent = (c.sources || {})[key] || "default";
    }
  }

  function settingRow(body, key, meta, value) {
    const kind = typeof value;
    const input = el("input", {
      id: `setting-${key}`, name: key, "data-key": key, "data-kind": kind,
      type: kind === "boolean" ? "checkbox" : "text",
      inputmode: kind === "number" ? "decimal" : null,
      "aria-describedby": `doc-${key} error-${key}`,
    });
    input.addEventListener("input", () => { input.dataset.dirty = "1"; });
    body.append(el("tr", { "data-setting": key },
      el("th", { scope: "row" }, el("label", { for: input.id, text: key })),
      el("td", {}, input, el("span", { id: `error-${key}`, class: "error", role: "alert" })),
      el("td", { id: `source-${key}` }),
      el("td", { id: `doc-${key}`, text: meta.doc })));
    return input;
  }

  function showValue(input, value) {
    if (input.type === "checkbox") input.checked = Boolean(value);
    else input.value = typeof value === "object" ? JSON.stringify(value) : String(value);
  }

  // What the field holds, typed like the setting. Text that does not parse is sent as it is,
  // so the API's validation names the field.
  function readValue(input) {
    if (input.type === "checkbox") return input.checked;
    const raw = input.value.trim();
    if (input.dataset.kind === "number") return raw !== "" && !isNaN(Number(raw)) ? Number(raw) : raw;
    if (input.dataset.kind === "object") { try { return JSON.parse(raw); } catch { return raw; } }
    return raw;
  }

  async function saveConfig(ev) {
    ev.preventDefault();
    const message = $("config-message");
    for (const e of $("settings").querySelectorAll(".error")) e.textContent = "";
    for (const e of $("settings").querySelectorAll("[aria-invalid]")) e.removeAttribute("aria-invalid");
    const patch = {};
    const changed = [];
    for (const input of $("settings").querySelectorAll("input[data-key]")) {
      const value = readValue(input);
      if (JSON.stringify(value) === input.dataset.server) continue;
      const key = input.dataset.key;
      const dot = key.indexOf(".");
      (patch[key.slice(0, dot)] ||= {})[key.slice(dot + 1)] = value;
      changed.push(input);
    }
    if (!changed.length) {
      message.textContent = "Nothing to save: no setting was changed.";
      return;
    }
    message.textContent = "Saving…";
    let resp;
    try {
      resp = await call("PATCH", "/admin/config", patch);
    } catch (e) {
      message.textContent = `Not saved: ${e.message}`;
      return;
    }
    const body = await json(resp);
    if (resp.ok) {
      savedGeneration = Math.max(savedGeneration, body.generation || 0);
      for (const input of changed) delete input.dataset.dirty;
      message.textContent = `Saved ${Object.keys(body.updated || {}).join(", ")} ` +
        `(generation ${body.generation}).`;
      await refresh();
      return;
    }
    const err = body.error || {};
    message.textContent = `Not saved: ${err.message || `HTTP ${resp.status}`}`;
    const problems = body.problems || (err.param ? { [err.param]: err.message } : {});
    for (const [key, why] of Object.entries(problems)) {
      const input = $(`setting-${key}`);
      if (!input) continue;
      input.setAttribute("aria-invalid", "true");
      $(`error-${key}`).textContent = why;
    }
  }

  // --- wiring -----------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", () => signOut("Signed out."));
    $("config-form").addEventListener("submit", saveConfig);
    if (sessionStorage.getItem(TOKEN)) start();
  });
})();
