// deepfleet web page: plain JS over the /v1 REST API (no framework, no build step).
// Routes: "#/" (submit + job list), "#/jobs/<id>" (events, log tail, loss/throughput plot).
"use strict";

const $ = (sel) => document.querySelector(sel);
// The token lives in sessionStorage: this tab only, gone when it closes, never written to the profile
// on disk (localStorage keeps it for every later visitor of the browser profile). See docs/security.md.
localStorage.removeItem("deepfleet.token");  // what older versions of this page kept
let token = sessionStorage.getItem("deepfleet.token") || "";
let timer = null;

async function api(method, path, { body, type } = {}) {
  const headers = {};
  if (token) headers["Authorization"] = "Bearer " + token;
  if (body !== undefined) headers["Content-Type"] = type || "application/json";
  const resp = await fetch(path, { method, headers, body });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = text; }
  if (!resp.ok) {
    const err = new Error((data && data.detail) || resp.statusText || ("HTTP " + resp.status));
    err.status = resp.status;
    err.errors = (data && data.errors) || [];
    throw err;
  }
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

function when(iso) { return iso ? new Date(iso).toLocaleString() : ""; }

// ---------------------------------------------------------------------------------------- submit
function showErrors(lines) {
  const ul = $("#errors");
  ul.replaceChildren(...lines.map((line) => el("li", {}, line)));
  ul.hidden = lines.length === 0;
}

async function submit(ev) {
  ev.preventDefault();
  showErrors([]);
  $("#submit-status").textContent = "submitting...";
  try {
    const job = await api("POST", "/v1/jobs", { body: $("#spec").value, type: "application/yaml" });
    $("#submit-status").replaceChildren("submitted ", el("a", { href: "#/jobs/" + job.id }, job.name));
    await refreshJobs();
  } catch (err) {
    $("#submit-status").textContent = err.message;
    showErrors(err.errors.length ? err.errors : [err.message]);
  }
}

// ---------------------------------------------------------------------------------------- job list
async function refreshJobs() {
  try {
    const page = await api("GET", "/v1/jobs?limit=100");
    const rows = page.items.map((j) => el("tr", { "data-job-id": j.id },
      el("td", {}, el("a", { href: "#/jobs/" + j.id }, j.name)),
      el("td", {}, el("span", { class: "phase " + j.phase }, j.phase)),
      el("td", {}, j.queue), el("td", {}, j.attempt),
      el("td", { class: "step" }, j.step == null ? "" : (j.max_steps ? `${j.step}/${j.max_steps}` : j.step)),
      el("td", {}, when(j.created_at))));
    $("#jobs tbody").replaceChildren(...rows);
    $("#jobs-status").textContent = page.total + " job(s)";
  } catch (err) {
    $("#jobs-status").textContent = err.status === 401 ? "paste an API token above to see jobs" : err.message;
  }
}

// ---------------------------------------------------------------------------------------- one job
const TERMINAL = ["SUCCEEDED", "FAILED", "CANCELLED"];
const NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function ticks(lo, hi, n) {
  if (hi === lo) return [lo];
  return Array.from({ length: n + 1 }, (_, i) => lo + (i * (hi - lo)) / n);
}

function fmt(v) { return Math.abs(v) >= 1000 ? v.toFixed(0) : v.toPrecision(3); }

// Loss (left axis) and throughput (right axis, tokens/s) against the optimizer step, with tick labels,
// a dot per heartbeat whose tooltip gives its values, redrawn on every refresh (live).
function plot(points, phase) {
  const svg = $("#plot");
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height");
  const L = 56, R = 64, T = 12, B = 36;
  svg.replaceChildren();
  const series = [
    { key: "loss", color: "#d9480f", label: "loss", side: "left" },
    { key: "tokens_per_s", color: "#1971c2", label: "throughput (tokens/s)", side: "right" },
  ];
  const pts = points.filter((p) => p.step != null);
  if (pts.length === 0) {
    $("#plot-legend").textContent = TERMINAL.includes(phase) ? "the job posted no heartbeats" : "no heartbeats yet";
    return;
  }
  const steps = pts.map((p) => p.step);
  const x0 = Math.min(...steps), x1 = Math.max(...steps);
  const sx = (s) => L + (x1 === x0 ? 0.5 : (s - x0) / (x1 - x0)) * (W - L - R);
  svg.append(svgEl("path", { d: `M${L},${T} V${H - B} H${W - R} V${T}`, stroke: "#adb5bd", fill: "none",
                             class: "axes" }));
  for (const t of ticks(x0, x1, Math.min(5, Math.max(1, x1 - x0)))) {
    svg.append(svgEl("text", { x: sx(t), y: H - B + 14, "text-anchor": "middle", "font-size": "11",
                               class: "tick-x" }, Math.round(t)));
  }
  svg.append(svgEl("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", "font-size": "11",
                             class: "axis-label" }, "optimizer step"));
  const legend = [];
  for (const s of series) {
    const vals = pts.filter((p) => p[s.key] != null);
    if (vals.length === 0) continue;
    const ys = vals.map((p) => p[s.key]);
    const lo = Math.min(...ys), hi = Math.max(...ys);
    const sy = (v) => H - B - (hi === lo ? 0.5 : (v - lo) / (hi - lo)) * (H - B - T);
    const x = s.side === "left" ? L - 4 : W - R + 4;
    for (const t of ticks(lo, hi, 4)) {
      svg.append(svgEl("text", { x, y: sy(t) + 4, "text-anchor": s.side === "left" ? "end" : "start",
                                 "font-size": "10", fill: s.color, class: `tick-${s.key}` }, fmt(t)));
    }
    svg.append(svgEl("text", { x: s.side === "left" ? 4 : W - 4, y: T + 2, "font-size": "11", fill: s.color,
                               "text-anchor": s.side === "left" ? "start" : "end", class: "axis-label" }, s.label));
    svg.append(svgEl("polyline", {
      points: vals.map((p) => `${sx(p.step).toFixed(1)},${sy(p[s.key]).toFixed(1)}`).join(" "),
      fill: "none", stroke: s.color, "stroke-width": "2", class: "series-" + s.key }));
    for (const p of vals) {  // hover: the heartbeat's values
      const dot = svgEl("circle", { cx: sx(p.step).toFixed(1), cy: sy(p[s.key]).toFixed(1), r: "3", fill: s.color,
                                    class: "point-" + s.key });
      dot.append(svgEl("title", {}, `step ${p.step}: ${s.label} ${fmt(p[s.key])}` +
                                    (p.time ? ` (${when(p.time)})` : "")));
      svg.append(dot);
    }
    const swatch = el("span", { class: "swatch" }, "\u25A0 ");
    swatch.style.color = s.color;  // CSSOM, which the page's CSP allows (a style attribute it would block)
    legend.push(el("span", {}, swatch, `${s.label}: ${fmt(ys[ys.length - 1])} at step ${vals[vals.length - 1].step}   `));
  }
  $("#plot-legend").replaceChildren(...legend, `${pts.length} heartbeat(s), steps ${x0}..${x1}`);
}

// One line saying what the job is doing now: queued behind whom, restarting because of what, progress and ETA.
async function describeNow(job, points) {
  const maxSteps = job.spec && job.spec.spec ? job.spec.spec.maxSteps : null;
  const hb = job.last_heartbeat;
  if (job.phase === "PENDING" || job.phase === "ADMITTED") {
    if (job.phase === "ADMITTED") return "admitted; starting its processes";
    try {
      const page = await api("GET", "/v1/jobs?limit=100");
      const ahead = page.items.filter((j) => j.id !== job.id && j.queue === job.queue &&
        (["ADMITTED", "RUNNING", "RESTARTING"].includes(j.phase) ||
         (j.phase === "PENDING" && j.created_at < job.created_at)));
      if (ahead.length === 0) return `queued in ${job.queue}: waiting for capacity`;
      return `queued in ${job.queue} behind ${ahead.length} job(s): ` + ahead.slice(0, 3).map((j) => `${j.name} (${j.phase})`).join(", ");
    } catch (err) { return `queued in ${job.queue}`; }
  }
  if (job.phase === "RESTARTING") return `restarting: ${job.message || "after a failure"}`;
  if (job.phase === "RUNNING") {
    if (!hb) return `attempt ${job.attempt} running; waiting for its first heartbeat`;
    let line = `training: step ${hb.step}` + (maxSteps ? ` of ${maxSteps}` : "");
    const recent = points.filter((p) => p.step != null && p.time).slice(-20);
    if (maxSteps && recent.length >= 2) {
      const a = recent[0], b = recent[recent.length - 1];
      const rate = (b.step - a.step) / ((new Date(b.time) - new Date(a.time)) / 1000);
      if (rate > 0) line += `, ${rate.toFixed(2)} steps/s, about ${Math.ceil((maxSteps - hb.step) / rate)} s left`;
    }
    return line;
  }
  return `${job.phase.toLowerCase()}` + (hb ? ` at step ${hb.step}` : "") + (job.message ? `: ${job.message}` : "");
}

function clearJob(title) {
  $("#job-title").textContent = title;
  $("#job-phase").textContent = "";
  $("#job-phase").className = "phase";
  $("#job-message").textContent = "";
  $("#job-now").textContent = "";
  $("#events tbody").replaceChildren();
  $("#plot").replaceChildren();
  $("#plot-legend").textContent = "";
  $("#log").textContent = "";
}

async function refreshJob(id) {
  try {
    const job = await api("GET", "/v1/jobs/" + id);
    if (location.hash.split("/")[2] !== id) return;  // the user moved on while this was loading
    $("#job-title").textContent = `${job.name} (${job.id})`;
    $("#job-phase").textContent = job.phase;
    $("#job-phase").className = "phase " + job.phase;
    $("#job-message").textContent = job.message || "";
    $("#cancel").disabled = ["SUCCEEDED", "FAILED", "CANCELLED"].includes(job.phase);
    const nodes = (job.attempts.length && job.attempts[job.attempts.length - 1].nodes) || 1;
    const select = $("#log-node");
    if (select.options.length !== nodes) {
      const keep = select.value;
      select.replaceChildren(...Array.from({ length: nodes }, (_, i) => el("option", { value: String(i) }, i)));
      if (+keep < nodes) select.value = keep;
    }
    const events = await api("GET", `/v1/jobs/${id}/events`);
    $("#events tbody").replaceChildren(...events.items.map((e) => el("tr", {},
      el("td", {}, when(e.time)), el("td", {}, e.attempt), el("td", {}, e.type), el("td", {}, e.message))));
    const metrics = await api("GET", `/v1/jobs/${id}/metrics`);
    plot(metrics.points, job.phase);
    $("#job-now").textContent = await describeNow(job, metrics.points);
    try {
      const log = await api("GET", `/v1/jobs/${id}/logs?tail=200&node=${select.value || 0}`);
      $("#log").textContent = log;
    } catch (err) {
      $("#log").textContent = err.message;
    }
  } catch (err) {
    clearJob(err.status === 404 ? `no job ${id} (or not in your project)` : err.message);
  }
}

async function cancelJob() {
  const id = location.hash.split("/")[2];
  try { await api("POST", `/v1/jobs/${id}/cancel`); } catch (err) { $("#job-message").textContent = err.message; }
  await refreshJob(id);
}

// ---------------------------------------------------------------------------------------- routing
function route() {
  clearInterval(timer);
  const parts = location.hash.replace(/^#/, "").split("/").filter(Boolean);
  const onJob = parts[0] === "jobs" && parts[1];
  $("#home").hidden = !!onJob;
  $("#job").hidden = !onJob;
  const refresh = onJob ? () => refreshJob(parts[1]) : refreshJobs;
  if (onJob) clearJob("loading " + parts[1] + " ...");  // never the previous job's status and events
  refresh();
  timer = setInterval(refresh, 2000);
}

$("#token").value = token;
$("#token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("#token").value.trim();
  sessionStorage.setItem("deepfleet.token", token);
  $("#token-status").textContent = token ? "token set" : "no token";
  route();
});
$("#submit-form").addEventListener("submit", submit);
$("#cancel").addEventListener("click", cancelJob);
$("#log-node").addEventListener("change", () => route());
window.addEventListener("hashchange", route);
route();
