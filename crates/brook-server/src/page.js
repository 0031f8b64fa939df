// brook's chat page script (served at /page.js; see page.html).
"use strict";
const $ = (id) => document.getElementById(id);

// ---- Markdown: block structure from raw lines, every text piece escaped on output. ----
function esc(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
          .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}
function inlineText(s) {
  let t = esc(s);
  t = t.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (m, label, url) =>
    /^(https?:\/\/|mailto:)/i.test(url)
      ? `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>` : m);
  t = t.replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>");
  t = t.replace(/__(?=\S)([^_]*?\S)__/g, "<strong>$1</strong>");
  t = t.replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?!\w)/g, "$1<em>$2</em>");
  t = t.replace(/(^|[^_\w])_(?=\S)([^_\n]*?\S)_(?!\w)/g, "$1<em>$2</em>");
  t = t.replace(/~~(?=\S)([^~]*?\S)~~/g, "<del>$1</del>");
  return t;
}
function inline(s) {
  // Code spans first, so nothing inside them is treated as Markdown.
  return s.split(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/).reduce((acc, part, i, all) => {
    if (i % 3 === 0) return acc + inlineText(part);
    if (i % 3 === 2) return acc + `<code>${esc(part)}</code>`;
    return acc;
  }, "");
}
const BLOCK = /^\s*(```|~~~|#{1,6}\s|>|[-*+]\s|\d+[.)]\s|\|)/;
function table(rows) {
  const cells = (r) => r.trim().replace(/^\||\|$/g, "").split("|").map((c) => c.trim());
  const head = cells(rows[0]);
  const body = rows.slice(2).map(cells);
  return "<table><thead><tr>" + head.map((c) => `<th>${inline(c)}</th>`).join("") +
    "</tr></thead><tbody>" + body.map((r) => "<tr>" + r.map((c) => `<td>${inline(c)}</td>`).join("") +
    "</tr>").join("") + "</tbody></table>";
}
function markdown(src) {
  const lines = String(src).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++;
      const lang = fence[2] ? `<span class="lang">${esc(fence[2])}</span>` : "";
      out.push(`<pre>${lang}<code>${esc(body.join("\n"))}</code></pre>`);
      continue;
    }
    const h = line.match(/^\s*(#{1,6})\s+(.*)$/);
    if (h) { out.push(`<h${h[1].length}>${inline(h[2])}</h${h[1].length}>`); i++; continue; }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { out.push("<hr>"); i++; continue; }
    if (/^\s*>/.test(line)) {
      const body = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) body.push(lines[i++].replace(/^\s*>\s?/, ""));
      out.push(`<blockquote>${markdown(body.join("\n"))}</blockquote>`);
      continue;
    }
    const list = line.match(/^\s*([-*+]|\d+[.)])\s+/);
    if (list) {
      const ordered = /\d/.test(list[1]);
      const items = [];
      while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i]) &&
             /\d/.test(lines[i].trim()[0]) === ordered) {
        items.push(`<li>${inline(lines[i++].replace(/^\s*([-*+]|\d+[.)])\s+/, ""))}</li>`);
      }
      out.push(ordered ? `<ol>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
      continue;
    }
    if (/^\s*\|/.test(line) && i + 1 < lines.length && /^\s*\|?\s*:?-+/.test(lines[i + 1])) {
      const rows = [];
      while (i < lines.length && /^\s*\|/.test(lines[i])) rows.push(lines[i++]);
      out.push(table(rows));
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const para = [];
    while (i < lines.length && lines[i].trim() && (para.length === 0 || !BLOCK.test(lines[i]))) {
      para.push(lines[i++]);
    }
    out.push(`<p>${para.map(inline).join("<br>")}</p>`);
  }
  return out.join("\n");
}
window.brookMarkdown = markdown;

// ---- Settings, kept in localStorage; the API key only in sessionStorage (gone with the tab). ----
const fields = ["system", "temperature", "max-tokens", "thinking", "api-key"];
const store = (f) => (f === "api-key" ? sessionStorage : localStorage);
function loadSettings() {
  localStorage.removeItem("brook.api-key"); // kept there by earlier versions
  for (const f of fields) {
    const v = store(f).getItem("brook." + f);
    if (v === null) continue;
    if ($(f).type === "checkbox") $(f).checked = v === "true"; else $(f).value = v;
  }
}
function saveSettings() {
  for (const f of fields) {
    store(f).setItem("brook." + f, $(f).type === "checkbox" ? String($(f).checked) : $(f).value);
  }
}
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// ---- Conversation. ----
let history = [];          // OpenAI messages, without the system prompt
let modelId = null;
let controller = null;

function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
function bubble(cls, text) {
  const d = document.createElement("div");
  d.className = "msg " + cls;
  if (text !== undefined) d.textContent = text;
  $("log").appendChild(d);
  d.scrollIntoView({ block: "end" });
  return d;
}
function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}
async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
    modelId = j.data[0].id;
    $("model").textContent = modelId + " · context " + (j.data[0].max_model_len || "?");
  } catch (e) {
    $("model").textContent = "cannot list models: " + e.message;
  }
}

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

function request(messages) {
  const body = { messages, stream: true, stream_options: { include_usage: true },
                 enable_thinking: $("thinking").checked };
  if (modelId) body.model = modelId;
  const t = parseFloat($("temperature").value);
  if (!Number.isNaN(t)) body.temperature = t;
  const m = parseInt($("max-tokens").value, 10);
  if (m > 0) body.max_tokens = m;
  return body;
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble("user", text);
  const box = bubble("assistant");
  const details = document.createElement("details");
  details.className = "reasoning";
  details.innerHTML = "<summary>Thinking…</summary><div class=\"text\"></div>";
  details.hidden = true;
  const content = document.createElement("div");
  content.className = "content";
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(details, content, stats);

  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
  const reply = { text: "", reasoning: "", chunks: 0, usage: null, timings: null };
  const started = performance.now();
  let first = null;
  let pending = false;
  let finished = false;   // the final stats line is written; a late frame must not redo it
  const paint = () => {
    pending = false;
    if (reply.reasoning) {
      details.hidden = false;
      details.querySelector(".text").textContent = reply.reasoning;
      if (!reply.text) details.open = true;
    }
    if (reply.text) { details.open = false; content.innerHTML = markdown(reply.text); }
    if (finished) return;
    const secs = first ? (performance.now() - first) / 1000 : 0;
    stats.textContent = plural(reply.chunks, "token") +
      (secs > 0.2 ? " · " + (reply.chunks / secs).toFixed(1) + " tok/s" : "");
    box.scrollIntoView({ block: "end" });
  };
  const schedule = () => { if (!pending) { pending = true; requestAnimationFrame(paint); } };

  controller = new AbortController();
  setBusy(true);
  $("status").textContent = "waiting for the model…";
  let stopped = false;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(request(messages)), signal: controller.signal });
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { const j = await r.json(); if (j.error) msg = j.error.message; } catch (_) {}
      throw new Error(msg);
    }
    $("status").textContent = "generating…";
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const j = JSON.parse(data);
      if (j.error) throw new Error(j.error.message);
      if (j.usage) reply.usage = j.usage;
      if (j.timings) reply.timings = j.timings;
      const d = j.choices && j.choices[0] && j.choices[0].delta;
      if (!d) continue;
      const piece = (d.content || "") + (d.reasoning_content || "");
      if (d.content) reply.text += d.content;
      if (d.reasoning_content) reply.reasoning += d.reasoning_content;
      if (d.tool_calls) reply.text += d.tool_calls.map((c) =>
        "\n`tool call: " + c.function.name + "(" + c.function.arguments + ")`\n").join("");
      if (piece) { reply.chunks++; if (!first) first = performance.now(); }
      schedule();
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else { box.classList.add("error"); content.textContent = "Error: " + e.message; }
  } finally {
    controller = null;
    setBusy(false);
  }
  paint();
  finished = true;
  details.querySelector("summary").textContent = reply.text ? "Thought" : "Thinking";
  const t = (reply.usage && reply.usage.timings) || reply.timings;
  const n = reply.usage ? reply.usage.completion_tokens : reply.chunks;
  let line = plural(n, "token");
  if (t && t.predicted_per_second) line += " · " + t.predicted_per_second.toFixed(1) + " tok/s";
  else if (first) line += " · " + (n / ((performance.now() - first) / 1000)).toFixed(1) + " tok/s";
  if (reply.usage) {
    line += " · prompt " + reply.usage.prompt_tokens + " (" +
      ((reply.usage.prompt_tokens_details || {}).cached_tokens || 0) + " cached)";
  }
  line += " · " + ((performance.now() - started) / 1000).toFixed(1) + " s";
  if (stopped) line += " · stopped";
  stats.textContent = line;
  $("status").textContent = stopped ? "stopped" : "";
  if (!box.classList.contains("error")) {
    history.push({ role: "assistant", content: reply.text });
  } else {
    history.pop();
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  $("log").innerHTML = "";
  $("status").textContent = "";
});
$("settings-toggle").addEventListener("click", () => {
  const s = $("settings");
  s.hidden = !s.hidden;
  $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
});
for (const f of fields) $(f).addEventListener("change", () => { saveSettings(); if (f === "api-key") loadModel(); });
loadSettings();
loadModel();
