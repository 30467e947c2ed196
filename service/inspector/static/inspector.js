// moeserve inspector: polls /inspect/api every 2 s and draws with plain DOM and SVG.
// Everything from the server is put in with textContent / attributes, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const PAGE_ROWS = 200; // rows asked for each refresh: the newest (the API has them all)
const SVG_NS = "http://www.w3.org/2000/svg";
const state = { filter: "all", selected: null, key: sessionStorage.getItem("moeserve-key") || "", layer: null, heat: null };

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name === "on") for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 1000) return (value / 1000).toFixed(2) + " s";
  return (value >= 100 ? value.toFixed(0) : value.toFixed(1)) + " ms";
}

class Unauthorized extends Error {}

async function api(path) {
  const headers = state.key ? { authorization: "Bearer " + state.key } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401) throw new Unauthorized("API key needed");
  if (!response.ok) {
    let message = "HTTP " + response.status;
    try { message = (await response.json()).error.message; } catch (_) { /* not the envelope */ }
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function problem(message) {
  const node = $("problem");
  node.hidden = !message;
  node.textContent = message || "";
  $("live").classList.toggle("stale", Boolean(message));
}

// ---- engine ---------------------------------------------------------------------------
function sparkline(svg, values, format, label) {
  svg.replaceChildren();
  const known = values.filter((v) => v !== null);
  const max = Math.max(1e-9, ...known);
  const step = 240 / Math.max(1, values.length - 1);
  const points = values.map((v, i) => `${(i * step).toFixed(1)},${(38 - ((v || 0) / max) * 36).toFixed(1)}`);
  svg.append(el("svg:polyline", { points: points.join(" ") }));
  const last = known.length ? known[known.length - 1] : null;
  $(label).textContent = last === null ? "idle" : format(last);
}

// The expert grid is one canvas (58 x 256 cells for DeepSeek-V3 would be 15k SVG nodes,
// redrawn every refresh); a cell's colour is its load / the layer's mean, so a hot expert
// stands out in any layer at any expert count. Hovering names the cell; the table beside
// it has a line per layer with its busiest experts.
const HEAT = { width: 960, height: 440, left: 34, top: 14, darkAt: 4 };

function heatmap(experts) {
  const canvas = $("heatmap");
  $("heatmap-empty").hidden = Boolean(experts);
  $("expert-view").hidden = !experts;
  state.heat = null;
  if (!experts) { canvas.width = 0; canvas.height = 0; return; }
  const rows = experts.tokens;
  const numExperts = experts.num_experts, numLayers = rows.length;
  const cw = Math.max(2, Math.min(28, Math.floor(HEAT.width / Math.max(1, numExperts))));
  const ch = Math.max(4, Math.min(16, Math.floor(HEAT.height / Math.max(1, numLayers))));
  canvas.width = HEAT.left + numExperts * cw + 4;
  canvas.height = HEAT.top + numLayers * ch + 4;
  canvas.dataset.layers = numLayers;
  canvas.dataset.experts = numExperts;
  const ctx = canvas.getContext("2d");
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = "#6b7385";
  const expertTick = Math.max(1, Math.ceil(numExperts / 16));
  for (let e = 0; e < numExperts; e += expertTick) ctx.fillText(String(e), HEAT.left + e * cw + 1, 10);
  const layerTick = Math.max(1, Math.ceil(12 / ch));
  const gapX = cw > 3 ? 1 : 0, gapY = ch > 5 ? 1 : 0;
  rows.forEach((row, layer) => {
    if (layer % layerTick === 0) { ctx.fillStyle = "#6b7385"; ctx.fillText("L" + layer, 0, HEAT.top + layer * ch + Math.min(ch, 11)); }
    const mean = row.reduce((a, b) => a + b, 0) / numExperts;
    row.forEach((tokens, expert) => {
      const ratio = mean ? tokens / mean : 0;
      ctx.fillStyle = `hsl(212, 70%, ${(97 - Math.min(1, ratio / HEAT.darkAt) * 62).toFixed(0)}%)`;
      ctx.fillRect(HEAT.left + expert * cw, HEAT.top + layer * ch, cw - gapX, ch - gapY);
    });
  });
  if (state.layer !== null && state.layer < numLayers) {
    ctx.strokeStyle = "#d1345b";
    ctx.strokeRect(HEAT.left - 0.5, HEAT.top + state.layer * ch - 0.5, numExperts * cw, ch);
  }
  state.heat = { rows, cw, ch, numExperts };
  expertLayers(experts);
}

function cellAt(event) {
  const heat = state.heat;
  if (!heat) return null;
  const box = $("heatmap").getBoundingClientRect();
  const expert = Math.floor((event.clientX - box.left - HEAT.left) / heat.cw);
  const layer = Math.floor((event.clientY - box.top - HEAT.top) / heat.ch);
  if (expert < 0 || expert >= heat.numExperts || layer < 0 || layer >= heat.rows.length) return null;
  return { layer, expert, tokens: heat.rows[layer][expert] };
}

function showCell(event) {
  const cell = cellAt(event);
  const readout = $("heatmap-readout");
  if (!cell) { readout.textContent = "hover a cell"; return; }
  const row = state.heat.rows[cell.layer];
  const mean = row.reduce((a, b) => a + b, 0) / state.heat.numExperts;
  const ratio = mean ? ` (${(cell.tokens / mean).toFixed(2)}x the layer's mean)` : "";
  readout.textContent = `layer ${cell.layer}, expert ${cell.expert}: ${cell.tokens} tokens${ratio}`;
  readout.dataset.layer = cell.layer;
  readout.dataset.expert = cell.expert;
}

// Below this many tokens per expert max/mean is mostly sampling noise (a balanced router
// over 256 experts reads 4x with 2 tokens each): shown muted, never flagged.
const STEADY_TOKENS_PER_EXPERT = 16;

function expertLayers(experts) {
  const rows = experts.layers.map((l) => {
    const steady = l.tokens >= STEADY_TOKENS_PER_EXPERT * experts.num_experts;
    const classes = [steady ? (l.imbalance > 3 ? "imbalanced" : "") : "sparse", l.layer === state.layer ? "selected" : ""];
    return el("tr", {
      "data-layer": l.layer, class: classes.join(" ").trim() || null,
      on: { click: () => { state.layer = state.layer === l.layer ? null : l.layer; heatmap(experts); } },
    },
    el("td", { class: "num", text: "L" + l.layer }),
    el("td", { class: "num", text: l.tokens }),
    el("td", {
      class: "num", text: l.tokens ? l.imbalance.toFixed(2) + "x" : "–",
      title: steady ? null : `under ${STEADY_TOKENS_PER_EXPERT} tokens per expert: mostly sampling noise`,
    }),
  el("td", { class: "mono" }, ...l.top.map((h) => el("span", {
    class: "hot-expert", "data-expert": h.expert, "data-tokens": h.tokens,
    text: `e${h.expert} ${((100 * h.tokens) / l.tokens).toFixed(1)}%`,
  }))));
  });
  document.querySelector("#expert-layers tbody").replaceChildren(...rows);
}

function renderEngine(engine) {
  $("model").textContent = engine.model;
  $("instance").textContent = engine.instance ? `on ${engine.instance}` : "";
  $("running").textContent = engine.running;
  $("waiting").textContent = engine.waiting;
  $("in-flight").textContent = engine.in_flight;
  $("kv").textContent = (engine.kv_usage * 100).toFixed(1) + " %";
  $("kv-bar").style.width = Math.min(100, engine.kv_usage * 100).toFixed(1) + "%";
  $("steps-total").textContent = engine.steps;
  const s = engine.series;
  sparkline($("spark-step"), s.step_ms, ms, "step-now");
  sparkline($("spark-tps"), s.tokens_per_s.map((v, i) => (s.step_ms[i] === null ? null : v)), (v) => v.toFixed(0), "tps-now");
  sparkline($("spark-batch"), s.batch_size, (v) => v.toFixed(1), "batch-now");
  heatmap(engine.experts);
}

// ---- requests -------------------------------------------------------------------------
function statusBadge(r) {
  const code = r.code || (r.outcome === "in_progress" ? "running" : "?");
  const label = r.outcome === "ok" || r.outcome === "in_progress" ? code : `${code} ${r.outcome}`;
  return el("span", { class: "badge " + r.outcome, text: label, title: r.error || r.status || "" });
}

function renderRequests(list) {
  $("count").textContent = `(${list.requests.length} shown, ${list.recorded} since start, ring of ${list.capacity})`;
  $("p95").textContent = list.slow_threshold_ms === null ? "" : "> " + ms(list.slow_threshold_ms);
  $("no-requests").hidden = list.requests.length > 0;
  const rows = list.requests.map((r) => el("tr", {
    "data-id": r.id, "data-request-id": r.request_id, "data-outcome": r.outcome, "data-api": r.api,
    class: r.id === state.selected ? "selected" : null,
    on: { click: () => select(r.id) },
  },
  el("td", { text: new Date(r.started_at * 1000).toLocaleTimeString(), title: r.request_id }),
  el("td", { text: r.api === "grpc" ? "gRPC" : "REST" }),
  el("td", { class: "status" }, statusBadge(r), r.slow ? el("span", { class: "badge slow", text: "slow" }) : null),
  el("td", { text: r.finish_reason || "–" }),
  el("td", { class: "num", text: r.prompt_tokens }),
  el("td", { class: "num", text: r.completion_tokens }),
  el("td", { class: "num", text: ms(r.queue_ms) }),
  el("td", { class: "num", text: ms(r.ttft_ms) }),
  el("td", { class: "num", text: ms(r.tpot_ms) }),
  el("td", { class: "num", text: ms(r.e2e_ms) }),
  el("td", { class: "mono", text: r.trace_id || "–" })));
  document.querySelector("#request-table tbody").replaceChildren(...rows);
}

// ---- one request ----------------------------------------------------------------------
function fact(name, value) {
  return el("div", {}, el("dt", { text: name }), el("dd", {}, value));
}

function timeline(detail) {
  const svg = $("timeline");
  svg.replaceChildren();
  const phases = detail.phases;
  const steps = detail.steps;
  const end = Math.max(1e-3, ...phases.map((p) => p.end_ms), ...steps.map((s) => s.at_ms + s.duration_ms));
  const x = (t) => (Math.max(0, t) / end) * 990 + 5;
  for (const p of phases) {
    svg.append(el("svg:rect", {
      class: "phase " + p.name, "data-phase": p.name, x: x(p.start_ms), y: 8,
      width: Math.max(1, x(p.end_ms) - x(p.start_ms)), height: 30,
    }, el("svg:title", { text: `${p.name}: ${ms(p.start_ms)} → ${ms(p.end_ms)}` })));
  }
  for (const s of steps) {
    svg.append(el("svg:rect", {
      class: "step " + s.phase, x: x(s.at_ms), y: 48, width: Math.max(1, x(s.at_ms + s.duration_ms) - x(s.at_ms)), height: 18,
    }, el("svg:title", { text: `step ${s.index}: ${s.phase}, batch ${s.batch_size}, ${ms(s.duration_ms)}` })));
  }
  if (detail.first_token_ms !== null) {
    const at = x(detail.first_token_ms);
    svg.append(el("svg:line", { class: "first-token", x1: at, x2: at, y1: 2, y2: 70 },
      el("svg:title", { text: "first token at " + ms(detail.first_token_ms) })));
  }
  svg.append(el("svg:text", { x: 5, y: 88, text: "0" }));
  svg.append(el("svg:text", { x: 995, y: 88, "text-anchor": "end", text: ms(end) }));
  if (!phases.length) svg.append(el("svg:text", { x: 500, y: 30, "text-anchor": "middle", text: "never ran in the engine" }));
}

function stepRows(detail) {
  const rows = detail.steps.map((s) => el("tr", { "data-step": s.index },
    el("td", { class: "num", text: s.index }),
    el("td", { class: "num", text: ms(s.at_ms) }),
    el("td", { class: "num", text: ms(s.duration_ms) }),
    el("td", { text: s.phase }),
    el("td", { class: "num", text: s.batch_size }),
    el("td", { class: "num", text: s.prefill_tokens }),
    el("td", { class: "num", text: s.decode_tokens }),
    el("td", { class: "num", text: (s.kv_usage * 100).toFixed(1) + " %" }),
    el("td", { class: "mono" }, ...s.others.map((o) => (o.id
      ? el("a", { href: "#", text: o.response_id + " ", on: { click: (ev) => { ev.preventDefault(); select(o.id); } } })
      : el("span", { text: o.response_id + " " }))),
    s.others_count > s.others.length ? el("span", { class: "muted", text: `+${s.others_count - s.others.length}` }) : null)));
  document.querySelector("#step-table tbody").replaceChildren(...rows);
  $("steps-note").textContent = detail.steps_omitted ? `(${detail.steps_omitted} steps in the middle not kept)` : "";
}

function logLines(lines) {
  const nodes = lines.map((line) => {
    let level = "info";
    try { level = JSON.parse(line).level || "info"; } catch (_) { /* not JSON: shown as is */ }
    return el("div", { class: "log-line " + level, text: line });
  });
  if (!nodes.length) nodes.push(el("div", { class: "muted", text: "no log lines with this trace id" }));
  $("logs").replaceChildren(...nodes);
}

function texts(detail) {
  const box = $("text");
  if (detail.prompt === null && detail.outputs === null) {
    box.replaceChildren(el("p", { class: "muted", text: "Prompt and output text are shown only when the server runs with --log-prompts." }));
    return;
  }
  box.replaceChildren(
    el("h4", { text: "prompt" }), el("div", { class: "text-block", text: detail.prompt || "" }),
    ...(detail.outputs || []).flatMap((t, i) => [el("h4", { text: "output " + i }), el("div", { class: "text-block", text: t })]));
}

function renderDetail(detail) {
  const r = detail.request;
  $("detail").hidden = false;
  $("detail-title").textContent = `${r.id} (${r.request_id})`;
  const trace = r.trace_id
    ? (detail.trace_url ? el("a", { href: detail.trace_url, target: "_blank", rel: "noopener", text: r.trace_id }) : el("span", { class: "mono", text: r.trace_id }))
    : "–";
  $("detail-facts").replaceChildren(...[
    fact("status", statusBadge(r)), fact("API", r.api === "grpc" ? "gRPC" : "REST"),
    fact("API key", r.key),
    fact("operation", `${r.operation || "–"}${r.stream ? " (stream)" : ""}`),
    fact("finish reason", r.finish_reason || "–"), fact("response id", r.response_id || "–"),
    fact("tokens", `${r.prompt_tokens} prompt, ${r.completion_tokens} completion`),
    fact("queue / TTFT", `${ms(r.queue_ms)} / ${ms(r.ttft_ms)}`),
    fact("TPOT / e2e", `${ms(r.tpot_ms)} / ${ms(r.e2e_ms)}`),
    // the per-request metrics an include_metrics response carries (the same numbers)
    detail.metrics && detail.metrics.tokens_per_second !== null
      ? fact("tokens/s", detail.metrics.tokens_per_second.toFixed(1)) : null,
    fact("preemptions", String(r.preemptions)),
    // speculative decoding: how many of its draft tokens the model kept
    r.spec_draft_tokens > 0 ? fact("drafts accepted", `${r.spec_accepted_tokens} of ${r.spec_draft_tokens} tokens (${(100 * r.spec_accepted_tokens / r.spec_draft_tokens).toFixed(0)}%)`) : null,
    fact("trace id", trace),
    r.error ? fact("error", r.error) : null,
  ].filter(Boolean));
  timeline(detail);
  stepRows(detail);
  logLines(detail.logs);
  texts(detail);
}

async function select(id) {
  state.selected = id;
  document.querySelectorAll("#request-table tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === id));
  try {
    await refreshDetail();
  } catch (error) {
    if (error instanceof Unauthorized) $("key-form").hidden = false;
    problem(error.message);
  }
}

async function refreshDetail() {
  if (!state.selected) return;
  try {
    renderDetail(await api("/inspect/api/requests/" + encodeURIComponent(state.selected)));
  } catch (error) {
    if (error.status === 404) { state.selected = null; $("detail").hidden = true; return; }
    throw error;
  }
}

// ---- the loop -------------------------------------------------------------------------
async function refresh() {
  try {
    const [engine, list] = await Promise.all([
      api("/inspect/api/engine"),
      api(`/inspect/api/requests?limit=${PAGE_ROWS}&filter=${state.filter}`),
    ]);
    renderEngine(engine);
    renderRequests(list);
    const selected = list.requests.find((r) => r.id === state.selected);
    if (selected && selected.outcome === "in_progress") await refreshDetail();
    $("key-form").hidden = true;
    problem("");
  } catch (error) {
    if (error instanceof Unauthorized) $("key-form").hidden = false;
    problem(error.message);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("filters").addEventListener("click", (ev) => {
    const button = ev.target.closest("button");
    if (!button) return;
    state.filter = button.dataset.filter;
    document.querySelectorAll("#filters button").forEach((b) => b.classList.toggle("on", b === button));
    refresh();
  });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("key").value;
    sessionStorage.setItem("moeserve-key", state.key);
    refresh();
  });
  $("close-detail").addEventListener("click", () => { $("detail").hidden = true; select(null); });
  $("heatmap").addEventListener("mousemove", showCell);
  refresh();
  setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);
});
