// The status page: plain DOM, no framework, no CDN. Every value goes in through
// textContent (never innerHTML), so a job name or an event message with HTML in it
// shows as text.
"use strict";

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "-";
  return typeof x === "number" ? x.toFixed(digits) : String(x);
}

function age(s) {
  if (s === null || s === undefined) return "-";
  if (s < 120) return s.toFixed(0) + "s";
  if (s < 7200) return (s / 60).toFixed(0) + "m";
  return (s / 3600).toFixed(1) + "h";
}

// --- the token: from the URL fragment (#token=...) or what was typed, kept in localStorage

function token() {
  const input = $("token");
  return input ? input.value.trim() : "";
}

function setupToken() {
  const input = $("token");
  if (!input) return;
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    localStorage.setItem("rrl-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  input.value = localStorage.getItem("rrl-token") || "";
  input.addEventListener("change", () => localStorage.setItem("rrl-token", input.value.trim()));
}

async function act(path, body) {
  const out = $("action-result");
  out.textContent = "...";
  const resp = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: "Bearer " + token() },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const d = data.detail;
    out.textContent = resp.status + ": " + (typeof d === "string" ? d : JSON.stringify(d));
    out.className = "reason";
    return null;
  }
  out.className = "muted";
  const d = data.desired;
  out.textContent = d
    ? "ok: desired rollout " + d.rollout + ", trainer " + d.trainer + (d.cancel ? ", cancel" : "")
    : "ok: " + JSON.stringify(data);
  return data;
}

// --- jobs overview

function renderJobs(jobs) {
  const body = $("jobs").tBodies[0];
  body.replaceChildren();
  for (const j of jobs) {
    const tr = el("tr");
    tr.dataset.job = j.id;
    const a = el("a", j.id);
    a.href = "/jobs/" + encodeURIComponent(j.id);
    const name = el("td");
    name.appendChild(a);
    tr.appendChild(name);
    const ph = el("td");
    ph.appendChild(el("span", j.phase, "phase phase-" + j.phase));
    tr.appendChild(ph);
    tr.appendChild(el("td", j.step + " / " + j.steps));
    const bar = el("div", null, "bar");
    const fill = el("div");
    fill.style.width = (100 * j.progress).toFixed(1) + "%";
    bar.appendChild(fill);
    const td = el("td");
    td.appendChild(bar);
    tr.appendChild(td);
    tr.appendChild(el("td", fmt(j.reward, 3)));
    tr.appendChild(el("td", age(j.age_s)));
    tr.appendChild(el("td", j.failures));
    tr.appendChild(el("td", j.recoveries));
    body.appendChild(tr);
  }
  $("empty").hidden = jobs.length > 0;
}

async function pollJobs() {
  try {
    const resp = await fetch("/api/v1/jobs");
    if (resp.ok) renderJobs((await resp.json()).jobs);
  } catch (e) {
    /* the controller went away: keep the last table, try again */
  }
  setTimeout(pollJobs, 2000);
}

// --- job page

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function plot(svg, points, key, markers, lastStep, evals) {
  svg.replaceChildren();
  const W = 600, H = 180, L = 48, R = 8, T = 8, B = 22;
  const pts = points.filter((p) => p[key] !== null && p[key] !== undefined);
  const evs = (evals || []).filter((e) => e.reward !== null && e.reward !== undefined);
  const xmax = Math.max(lastStep || 1, ...pts.map((p) => p.step), ...evs.map((e) => e.step), 1);
  let ymin = Math.min(...pts.map((p) => p[key]), ...evs.map((e) => e.reward));
  let ymax = Math.max(...pts.map((p) => p[key]), ...evs.map((e) => e.reward));
  if (!pts.length) { ymin = 0; ymax = 1; }
  if (ymax - ymin < 1e-9) { ymax += 0.5; ymin -= 0.5; }
  const x = (s) => L + ((W - L - R) * s) / xmax;
  const y = (v) => T + (H - T - B) * (1 - (v - ymin) / (ymax - ymin));
  svg.appendChild(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#c9ced6" }));
  svg.appendChild(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#c9ced6" }));
  for (const [v, yy] of [[ymax, y(ymax)], [ymin, y(ymin)]]) {
    const t = svgEl("text", { x: L - 4, y: yy + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7380" });
    t.textContent = Number(v).toPrecision(3);
    svg.appendChild(t);
  }
  const t = svgEl("text", { x: W - R, y: H - 6, "text-anchor": "end", "font-size": 10, fill: "#6b7380" });
  t.textContent = "step " + xmax;
  svg.appendChild(t);
  for (const m of markers) {
    const colour = m.what === "fault" ? "#dc2626" : "#16a34a";
    const line = svgEl("line", { x1: x(m.step), y1: T, x2: x(m.step), y2: H - B, stroke: colour,
      "stroke-dasharray": m.what === "fault" ? "4 2" : "", "data-what": m.what });
    const title = svgEl("title", {});
    title.textContent = m.kind + ": " + m.message;
    line.appendChild(title);
    svg.appendChild(line);
    // a shape of its own, so that a fault and its recovery at the same step both show:
    // a triangle at the top for a fault, a dot at the bottom for a recovery
    const cx = x(m.step);
    const shape = m.what === "fault"
      ? svgEl("polygon", { points: (cx - 4) + "," + T + " " + (cx + 4) + "," + T + " " + cx + "," + (T + 7), fill: colour, "data-what": m.what })
      : svgEl("circle", { cx, cy: H - B - 3, r: 3, fill: colour, "data-what": m.what });
    const t2 = svgEl("title", {});
    t2.textContent = title.textContent;
    shape.appendChild(t2);
    svg.appendChild(shape);
  }
  if (pts.length) {
    const d = pts.map((p, i) => (i ? "L" : "M") + x(p.step).toFixed(1) + " " + y(p[key]).toFixed(1)).join(" ");
    svg.appendChild(svgEl("path", { d, fill: "none", stroke: "#3b82f6", "stroke-width": 1.5 }));
  }
  for (const e of evs) {  // the evaluations: a dot each at the step after which the policy was evaluated
    const dot = svgEl("circle", { cx: x(e.step), cy: y(e.reward), r: 3.5, fill: "#f59e0b", "data-what": "eval" });
    const title = svgEl("title", {});
    title.textContent = "eval of policy v" + e.version + ": reward " + fmt(e.reward, 3) + ", pass@" + e.k + " " +
      fmt(e.pass_at_k, 3) + " over " + e.prompts + " prompts";
    dot.appendChild(title);
    svg.appendChild(dot);
  }
}

function renderWorkers(groups, job, allowKill) {
  const box = $("workers");
  box.replaceChildren();
  const names = Object.keys(groups).sort();
  if (!names.length) box.appendChild(el("p", "no workers registered", "muted"));
  for (const g of names) {
    box.appendChild(el("h3", g + " (" + groups[g].length + ")"));
    const table = el("table", null, "grid");
    table.id = "workers-" + g;
    const head = el("tr");
    for (const h of ["id", "node", "pid", "state", "policy version", "last progress", "restarts", ""]) head.appendChild(el("th", h));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const w of groups[g]) {
      const tr = el("tr");
      tr.dataset.worker = w.id;
      for (const v of [w.id, w.node, w.pid, w.state, fmt(w.policy_version, 0), age(w.progress_age_s) + " ago", w.restarts]) {
        tr.appendChild(el("td", v));
      }
      const td = el("td");
      if (allowKill) {  // the controller serves the kill route only with --allow-kill (chaos testing)
        const btn = el("button", "kill", "danger");
        btn.title = "chaos: SIGKILL this worker's process (only on the controller's own host)";
        btn.addEventListener("click", () => {
          if (confirm("Kill " + g + " worker " + w.id + " (pid " + w.pid + ")?")) {
            act("/api/v1/jobs/" + encodeURIComponent(job) + "/workers/" + encodeURIComponent(g) + "/" + encodeURIComponent(w.id) + "/kill");
          }
        });
        td.appendChild(btn);
      }
      if (g === "rollout" || g === "trainer") {  // its captured stdout/stderr (the logs route needs the token)
        const lb = el("button", "logs", "logs");
        lb.title = "this worker's output: stdout and stderr, tracebacks included";
        lb.addEventListener("click", () => showLogs(job, g, w.id));
        td.appendChild(lb);
      }
      tr.appendChild(td);
      body.appendChild(tr);
    }
    box.appendChild(table);
  }
}

async function showLogs(job, group, id) {  // group null: every worker's, merged
  const view = $("log-view");
  $("log-panel").hidden = false;
  $("log-title").textContent = "logs of " + (group === null ? "every worker" : group + " " + id) + " (the newest 300 lines)";
  view.textContent = "...";
  const q = group === null ? "?limit=300"
    : "?group=" + encodeURIComponent(group) + "&worker=" + encodeURIComponent(id) + "&limit=300";
  const resp = await fetch("/api/v1/jobs/" + encodeURIComponent(job) + "/logs" + q,
    { headers: { Authorization: "Bearer " + token() } });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const d = data.detail;
    view.textContent = resp.status + ": " + (typeof d === "string" ? d : JSON.stringify(d));
    return;
  }
  view.textContent = data.lines.length
    ? data.lines.map((x) => new Date(x.time * 1000).toLocaleTimeString() + (group === null ? " [" + x.source + "] " : " ") + x.text).join("\n")
    : "(nothing captured yet in " + data.folder + ")";
}

function renderTable(id, rows, cells, rowClass) {
  const body = $(id).tBodies[0];
  body.replaceChildren();
  for (const r of rows) {
    const tr = el("tr", null, rowClass ? rowClass(r) : "");
    if (r.seq !== undefined) tr.dataset.seq = r.seq;
    if (r.kind !== undefined) tr.dataset.kind = r.kind;
    cells(r).forEach((v, i, all) => tr.appendChild(el("td", v, i === all.length - 2 ? "msg" : "")));
    body.appendChild(tr);
  }
}

// --- the event table: faults and recoveries first (the view's `category`), repeated snapshots folded

const SHOWN = {
  faults: new Set(["fault", "recovery", "preemption", "job"]),
  preemptions: new Set(["preemption"]),
  scaling: new Set(["scaling", "job"]),
  snapshots: new Set(["snapshot"]),
  all: null,
};
let lastEvents = [];

function foldSnapshots(rows) {  // newest first: a run of snapshot rows becomes one row with a count
  const out = [];
  for (const e of rows) {
    const prev = out[out.length - 1];
    if (e.kind === "snapshot" && prev && prev.kind === "snapshot") {
      prev.count = (prev.count || 1) + 1;
      prev.oldestTime = e.time;
      continue;
    }
    out.push(Object.assign({}, e));
  }
  for (const e of out) {
    if (e.count) e.message = e.message + " (and " + (e.count - 1) + " more since " +
      new Date(e.oldestTime * 1000).toLocaleTimeString() + ")";
  }
  return out;
}

function faultDetails(e) {
  if (e.category !== "fault") return e.seconds !== undefined ? fmt(e.seconds, 1) + "s" : "";
  const parts = [];
  parts.push(e.detection_s !== undefined && e.detection_s !== null ? "detected in " + fmt(e.detection_s, 1) + "s" : "-");
  parts.push(e.path || "-");
  parts.push(e.mttr_s !== undefined ? "back in " + fmt(e.mttr_s, 1) + "s" : "not yet back");
  return parts.join(" \u00b7 ");
}

function renderEvents() {
  const which = SHOWN[$("event-filter").value];
  const rows = foldSnapshots(lastEvents.slice().reverse().filter((e) => !which || which.has(e.category)));
  renderTable("timeline", rows,
    (e) => [new Date(e.time * 1000).toLocaleTimeString(), e.kind, e.message, faultDetails(e)],
    (e) => (e.category === "fault" || e.category === "recovery" || e.category === "preemption" ? e.category : ""));
  for (const tr of $("timeline").tBodies[0].rows) {
    const e = rows[tr.sectionRowIndex];
    if (e.count) tr.dataset.count = e.count;
  }
}

// --- the worker timeline: a strip per worker, a colour per state, faults marked

const STATE_COLOURS = {
  busy: "#3b82f6", training: "#8b5cf6", snapshotting: "#f59e0b", loading: "#06b6d4",
  idle: "#d1d5db", ready: "#d1d5db", starting: "#bef264", warming: "#bef264", spare: "#e5e7eb", gone: "#1f2937",
};
const STATE_NAMES = { busy: "generating", idle: "idle", ready: "idle", gone: "gone (dead or drained)" };

function renderStrips(tl) {
  const svg = $("strips");
  svg.replaceChildren();
  if (!tl || !tl.rows.length) { $("strips-legend").textContent = "no samples yet"; return; }
  const W = 1000, L = 140, R = 10, RH = 18, T = 4;
  const H = T + tl.rows.length * RH + 16;
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  const x = (t) => L + ((W - L - R) * (t - tl.from)) / Math.max(1, tl.to - tl.from);
  tl.rows.forEach((row, i) => {
    const y = T + i * RH;
    const label = svgEl("text", { x: L - 6, y: y + RH - 5, "text-anchor": "end", "font-size": 12, fill: "#374151" });
    label.textContent = row.worker;
    svg.appendChild(label);
    const g = svgEl("g", { "data-worker": row.worker });
    for (const [state, t0, t1] of row.runs) {
      const rect = svgEl("rect", { x: x(t0), y: y + 2, width: Math.max(1, x(t1) - x(t0)), height: RH - 5,
        fill: STATE_COLOURS[state] || "#ffffff", stroke: "#9ca3af", "stroke-width": 0.3, "data-state": state });
      const title = svgEl("title", {});
      title.textContent = row.worker + ": " + (STATE_NAMES[state] || state) + " " +
        new Date(t0 * 1000).toLocaleTimeString() + " - " + new Date(t1 * 1000).toLocaleTimeString();
      rect.appendChild(title);
      g.appendChild(rect);
    }
    svg.appendChild(g);
  });
  for (const f of tl.faults || []) {  // a rollout fault on its worker's strip, a trainer fault on every rank's
    if (f.time < tl.from) continue;
    tl.rows.forEach((row, i) => {
      const [group, worker] = row.worker.split("/");
      const hit = f.kind.startsWith("rollout") ? group === "rollout" && String(f.worker) === worker
        : f.kind.startsWith("trainer") && group === "trainer";
      if (!hit) return;
      svg.appendChild(svgEl("line", { x1: x(f.time), x2: x(f.time), y1: T + i * RH, y2: T + (i + 1) * RH,
        stroke: "#dc2626", "stroke-width": 2, "data-what": "fault" }));
    });
  }
  const t = svgEl("text", { x: W - R, y: H - 3, "text-anchor": "end", "font-size": 11, fill: "#6b7380" });
  t.textContent = new Date(tl.from * 1000).toLocaleTimeString() + " - " + new Date(tl.to * 1000).toLocaleTimeString();
  svg.appendChild(t);
  $("strips-legend").textContent = "generating (blue) \u00b7 training (violet) \u00b7 snapshotting (amber) \u00b7 " +
    "loading weights (cyan) \u00b7 idle (grey) \u00b7 starting (green) \u00b7 gone (black) \u00b7 fault (red line)";
}

const ENDED = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
let stream = null;  // the job page's live view (closed once the job has ended)

function renderView(v) {
  const s = v.summary;
  const ended = ENDED.has(s.phase);
  // a finished job takes no scale or cancel; the token stays (the workers' logs need it)
  for (const id of ["scale-rollout", "do-scale-rollout", "scale-trainer", "do-scale-trainer", "do-cancel"]) {
    const e = $(id);
    (e.closest("label") || e).hidden = ended;
  }
  $("phase").textContent = s.phase;
  $("phase").className = "phase phase-" + s.phase;
  $("reason").textContent = s.reason || "";
  $("reason").hidden = !s.reason;
  $("reason-logs").hidden = s.phase !== "FAILED";  // the reason is one line: the traceback is in the logs
  $("step").textContent = s.step;
  $("steps").textContent = s.steps;
  $("bar").style.width = (100 * s.progress).toFixed(1) + "%";
  $("policy").textContent = s.policy_version;
  $("reward").textContent = fmt(s.reward, 3);
  $("tps").textContent = fmt(s.tokens_per_s, 0);
  $("failures").textContent = s.failures;
  $("recoveries").textContent = s.recoveries;
  $("preemptions").textContent = s.preemptions;
  const g = v.goodput || {};
  $("ettr").textContent = fmt(g.ettr, 2) + " (" + fmt(g.ettr_last_hour, 2) + ")";
  $("goodput").textContent = "goodput: ETTR " + fmt(g.ettr, 3) + " since the first step, " + fmt(g.ettr_last_hour, 3) +
    " over the last hour; " + (g.steps_replayed || 0) + " steps replayed, " + (g.samples_regenerated_est || 0) +
    " samples regenerated (estimate), " + fmt(g.recovery_s || 0, 1) + " s in recovery over " + (g.faults || 0) + " fault(s)";
  // controllers by id, with the host and pid they run as (an id is not a host name)
  const where = (c) => (c && c.node ? " on " + c.node + (c.pid ? " (pid " + c.pid + ")" : "") : "");
  $("leader").textContent = v.leader ? v.leader + where(v.controllers.find((c) => c.id === v.leader)) : "none";
  $("served-by").textContent = v.served_by || "-";
  $("controllers").textContent = v.controllers.map((c) => c.id + (c.leader ? " (leader)" : "") + where(c)).join(", ");
  plot($("plot-reward"), v.history, "reward", v.markers, s.step, v.evals);
  const last = (v.evals || []).slice(-1)[0];
  $("eval-last").textContent = last ? "last eval (v" + last.version + "): reward " + fmt(last.reward, 3) + ", pass@" +
    last.k + " " + fmt(last.pass_at_k, 3) : "";
  plot($("plot-tps"), v.history, "tokens_per_s", v.markers, s.step);
  renderWorkers(v.workers, s.id, !!v.allow_kill && !ended);  // no kill button on a job that has ended
  renderTable("checkpoints", v.checkpoints.slice().reverse(), (c) => [
    c.step, c.bytes ? (c.bytes / 1e6).toFixed(1) + " MB" : "-", fmt(c.blocking_s, 3), fmt(c.seconds, 2), c.status,
  ]);
  lastEvents = v.events;
  renderEvents();
  renderStrips(v.timeline);
  if (ended) {
    const ver = v.verified;  // the newest `rrl verify`, if one was run
    $("live").textContent = "ended: " + s.phase.toLowerCase() + " at step " + s.step + ", final reward " +
      fmt(s.reward, 3) + (ver ? "; rrl verify: " + (ver.match ? "match (" + ver.steps + " steps replayed)" : "MISMATCH") +
      " at " + new Date(ver.time * 1000).toLocaleString() : "; not verified (rrl verify " + s.id + ")") +
      " (as of " + new Date(v.time * 1000).toLocaleTimeString() + ")";
    if (stream) { stream.close(); stream = null; }
  } else {
    $("live").textContent = "live, updated " + new Date(v.time * 1000).toLocaleTimeString();
  }
}

function setupJob() {
  const job = document.body.dataset.job;
  setupToken();
  const initial = JSON.parse($("initial-view").textContent);
  renderView(initial);
  const base = "/api/v1/jobs/" + encodeURIComponent(job);
  $("do-scale-rollout").addEventListener("click", () => act(base + "/scale", { rollout: Number($("scale-rollout").value) }));
  $("do-scale-trainer").addEventListener("click", () => act(base + "/scale", { trainer: Number($("scale-trainer").value) }));
  $("do-cancel").addEventListener("click", () => { if (confirm("Cancel job " + job + "?")) act(base + "/cancel"); });
  $("log-close").addEventListener("click", () => { $("log-panel").hidden = true; });
  $("event-filter").addEventListener("change", renderEvents);
  $("reason-logs").addEventListener("click", () => showLogs(job, null, null));
  if (ENDED.has(initial.summary.phase)) return;  // nothing more will change: no live stream
  const source = stream = new EventSource(base + "/stream");
  source.addEventListener("view", (ev) => renderView(JSON.parse(ev.data)));
  source.addEventListener("trouble", (ev) => { $("live").textContent = "etcd trouble: " + JSON.parse(ev.data).detail; });
  source.addEventListener("gone", () => { $("live").textContent = "job deleted"; source.close(); stream = null; });
  source.onerror = () => { if (stream) $("live").textContent = "reconnecting..."; };
}

if (document.body.dataset.page === "job") setupJob();
else setTimeout(pollJobs, 2000);
