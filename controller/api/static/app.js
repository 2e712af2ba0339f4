// deepfleet web page: plain JS over the /v1 REST API (no framework, no build step).
// Routes: "#/" (submit + job list), "#/jobs/<id>" (events, log tail, loss/throughput plot).
"use strict";

const $ = (sel) => document.querySelector(sel);
let token = localStorage.getItem("deepfleet.token") || "";
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
      el("td", {}, j.last_heartbeat ? j.last_heartbeat.step : ""),
      el("td", {}, when(j.created_at))));
    $("#jobs tbody").replaceChildren(...rows);
    $("#jobs-status").textContent = page.total + " job(s)";
  } catch (err) {
    $("#jobs-status").textContent = err.status === 401 ? "paste an API token above to see jobs" : err.message;
  }
}

// ---------------------------------------------------------------------------------------- one job
function plot(points) {
  const svg = $("#plot");
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), P = 36;
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const series = [
    { key: "loss", color: "#d9480f", label: "loss" },
    { key: "tokens_per_s", color: "#1971c2", label: "tokens/s" },
  ];
  const pts = points.filter((p) => p.step != null);
  if (pts.length === 0) { $("#plot-legend").textContent = "no heartbeats yet"; return; }
  const steps = pts.map((p) => p.step);
  const x0 = Math.min(...steps), x1 = Math.max(...steps) || 1;
  const sx = (s) => P + (x1 === x0 ? 0.5 : (s - x0) / (x1 - x0)) * (W - 2 * P);
  const axis = document.createElementNS(ns, "path");
  axis.setAttribute("d", `M${P},${P / 2} V${H - P} H${W - P}`);
  axis.setAttribute("stroke", "#adb5bd"); axis.setAttribute("fill", "none");
  svg.append(axis);
  const legend = [];
  for (const s of series) {
    const vals = pts.filter((p) => p[s.key] != null);
    if (vals.length === 0) continue;
    const ys = vals.map((p) => p[s.key]);
    const lo = Math.min(...ys), hi = Math.max(...ys);
    const sy = (v) => H - P - (hi === lo ? 0.5 : (v - lo) / (hi - lo)) * (H - 1.5 * P);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", vals.map((p) => `${sx(p.step).toFixed(1)},${sy(p[s.key]).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", s.color); line.setAttribute("stroke-width", "2");
    line.setAttribute("class", "series-" + s.key);
    svg.append(line);
    const swatch = el("span", { style: `color:${s.color};font-weight:700` }, "\u25A0 ");
    legend.push(el("span", {}, swatch,
      `${s.label}: ${ys[ys.length - 1].toPrecision(4)} (range ${lo.toPrecision(3)}..${hi.toPrecision(3)})   `));
  }
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", W - P); label.setAttribute("y", H - 8); label.setAttribute("text-anchor", "end");
  label.setAttribute("font-size", "11"); label.textContent = `step ${x0}..${x1}`;
  svg.append(label);
  $("#plot-legend").replaceChildren(...legend);
}

async function refreshJob(id) {
  try {
    const job = await api("GET", "/v1/jobs/" + id);
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
    plot(metrics.points);
    try {
      const log = await api("GET", `/v1/jobs/${id}/logs?tail=200&node=${select.value || 0}`);
      $("#log").textContent = log;
    } catch (err) {
      $("#log").textContent = err.message;
    }
  } catch (err) {
    $("#job-title").textContent = err.message;
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
  refresh();
  timer = setInterval(refresh, 2000);
}

$("#token").value = token;
$("#token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("#token").value.trim();
  localStorage.setItem("deepfleet.token", token);
  $("#token-status").textContent = token ? "token set" : "no token";
  route();
});
$("#submit-form").addEventListener("submit", submit);
$("#cancel").addEventListener("click", cancelJob);
$("#log-node").addEventListener("change", () => route());
window.addEventListener("hashchange", route);
route();
