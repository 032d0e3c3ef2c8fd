// The SpecSplit playground: streams one prompt through the public API (SSE) with the
// `include_provenance` extension and shows each token where it came from; optionally the
// same prompt again with speculation off. Plain JS, no build step.
"use strict";

const $ = (id) => document.getElementById(id);

function settings() {
  return {
    prompt: $("prompt").value,
    mode: document.querySelector("input[name=mode]:checked").value,
    maxTokens: parseInt($("max_tokens").value, 10) || 64,
    temperature: parseFloat($("temperature").value) || 0,
    compare: $("compare").checked,
  };
}

// ?prompt=...&mode=chat|completion&max_tokens=N&temperature=T&compare=1&autorun=1
function fromUrl() {
  const q = new URLSearchParams(location.search);
  if (q.has("prompt")) $("prompt").value = q.get("prompt");
  if (q.has("mode")) document.querySelector(`input[name=mode][value=${CSS.escape(q.get("mode"))}]`).checked = true;
  if (q.has("max_tokens")) $("max_tokens").value = q.get("max_tokens");
  if (q.has("temperature")) $("temperature").value = q.get("temperature");
  if (q.has("compare")) $("compare").checked = q.get("compare") === "1";
  return q.get("autorun") === "1";
}

function updateLink() {
  const s = settings();
  const q = new URLSearchParams({
    prompt: s.prompt, mode: s.mode, max_tokens: s.maxTokens, temperature: s.temperature,
    compare: s.compare ? "1" : "0", autorun: "1",
  });
  $("link").href = `${location.pathname}?${q}`;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch (e) {
    return `${response.status} ${response.statusText}`;
  }
}

async function modelName() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw new Error(await errorOf(response));
  return (await response.json()).data[0].id;
}

function requestBody(s, model, off) {
  const body = {
    model, stream: true, max_tokens: s.maxTokens, temperature: s.temperature,
    stream_options: { include_usage: true, include_provenance: true },
    speculation_stats: true,
  };
  if (s.mode === "chat") body.messages = [{ role: "user", content: s.prompt }];
  else body.prompt = s.prompt;
  if (off) body.speculation = { method: "off" };
  return body;
}

// Server-sent events from a fetch body: yields each `data:` payload.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

// One panel: its output, rounds table and totals.
class Panel {
  constructor(name) {
    this.name = name;
    this.section = $(name);
    this.output = $(`${name}-output`);
    this.rounds = $(`${name}-rounds`);
    this.totals = $(`${name}-totals`);
    this.error = $(`${name}-error`);
  }

  reset() {
    this.output.textContent = "";
    this.error.textContent = "";
    this.totals.textContent = "";
    this.rounds.innerHTML =
      "<tr><th>round</th><th>tree nodes</th><th>accepted</th><th>tokens</th><th>forwards</th><th>draft ms</th><th>verify ms</th></tr>";
    this.lastRound = 0;
    this.last = null;
    this.section.dataset.state = "running";
  }

  token(t) {
    if (this.last && Number(this.last.dataset.i) === t.i) {  // the rest of a split token
      this.last.textContent += t.text;
      return;
    }
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = t.text;
    span.dataset.i = t.i;
    span.dataset.source = t.source;
    span.dataset.round = t.round;
    span.dataset.kind = t.kind;
    if (t.drafter) span.dataset.drafter = t.drafter;
    if (t.round !== this.lastRound) span.dataset.roundStart = "";
    this.lastRound = t.round;
    const from = t.source === "draft" ? `draft (${t.drafter}), accepted` : `target, ${t.kind}`;
    span.title = `round ${t.round}: ${from}`;
    this.output.appendChild(span);
    this.last = span;
  }

  text(text) {  // text without provenance (a server without the extension)
    this.output.appendChild(document.createTextNode(text));
    this.last = null;
  }

  round(r) {
    const row = this.rounds.insertRow();
    for (const v of [r.round, r.tree_nodes, r.accepted, r.tokens, r.forwards, r.draft_ms, r.verify_ms]) {
      row.insertCell().textContent = v;
    }
  }

  show(totals) {
    this.totals.textContent = "";
    for (const [key, label, value] of totals) {
      const dt = document.createElement("dt");
      dt.textContent = label;
      const dd = document.createElement("dd");
      dd.id = `${this.name}-${key}`;
      dd.textContent = value;
      this.totals.append(dt, dd);
    }
  }

  fail(message) {
    this.error.textContent = message;
    this.section.dataset.state = "error";
  }
}

// Streams one run into a panel; returns its figures (null when it failed).
async function run(panel, s, model, off) {
  const url = s.mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const started = performance.now();
  let firstAt = null, usage = null, stats = null, fromDraft = 0;
  try {
    const response = await fetch(url, {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody(s, model, off)),
    });
    if (!response.ok) throw new Error(await errorOf(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.speculation_stats) stats = chunk.speculation_stats;
      const choice = chunk.choices && chunk.choices[0];
      const text = choice ? (s.mode === "chat" ? choice.delta.content : choice.text) : "";
      const ext = chunk.specsplit;
      if (ext) {
        for (const r of ext.rounds) panel.round(r);
        for (const t of ext.tokens) {
          if (t.source === "draft") fromDraft += 1;
          panel.token(t);
        }
      } else if (text) {
        panel.text(text);
      }
      if (text && firstAt === null) firstAt = performance.now();
    }
  } catch (e) {
    panel.fail(String(e.message || e));
    return null;
  }
  const seconds = (performance.now() - started) / 1000;
  const tokens = usage ? usage.completion_tokens : 0;
  const figures = {
    tokens, seconds, tps: tokens / seconds,
    ttft: firstAt === null ? null : (firstAt - started) / 1000,
  };
  const totals = [
    ["tokens", "tokens", tokens],
    ["tps", "tokens/s", figures.tps.toFixed(1)],
    ["seconds", "time", `${seconds.toFixed(2)} s`],
    ["ttft", "first token", figures.ttft === null ? "—" : `${(figures.ttft * 1000).toFixed(0)} ms`],
  ];
  if (stats) {
    totals.push(
      ["acceptance", "acceptance", `${(100 * stats.acceptance_rate).toFixed(1)}%`],
      ["tau", "tokens / target forward", stats.mean_accepted_length.toFixed(2)],
      ["forwards", "target forwards", stats.verify_steps],
      ["drafted", "from the draft", `${fromDraft} of ${tokens}`],
    );
  }
  panel.show(totals);
  panel.section.dataset.state = "done";
  return figures;
}

async function start(event) {
  if (event) event.preventDefault();
  const s = settings();
  updateLink();
  document.body.dataset.state = "running";
  const spec = new Panel("spec"), off = new Panel("off");
  spec.reset();  // both panels are "running" from now until their run ends
  off.reset();
  $("off").hidden = !s.compare;
  $("speedup").textContent = "";
  delete $("speedup").dataset.ratio;
  $("run").disabled = true;
  try {
    let model;
    try {
      model = await modelName();
    } catch (e) {
      spec.fail(String(e.message || e));
      off.fail("not run");
      return;
    }
    const on = await run(spec, s, model, false);
    if (!s.compare) {
      off.section.dataset.state = "idle";
      return;
    }
    const plain = await run(off, s, model, true);  // one after the other: no shared cores
    if (on && plain) {
      $("speedup").textContent =
        `speculation on: ${on.tps.toFixed(1)} tokens/s, off: ${plain.tps.toFixed(1)} tokens/s ` +
        `(${(on.tps / plain.tps).toFixed(2)}x)`;
      $("speedup").dataset.ratio = (on.tps / plain.tps).toFixed(3);
    }
  } finally {
    $("run").disabled = false;
    document.body.dataset.state = "done";
  }
}

$("form").addEventListener("submit", start);
$("form").addEventListener("input", updateLink);
const autorun = fromUrl();
updateLink();
if (autorun) start();
