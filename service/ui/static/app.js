// ftrain dashboard: one page, three views (#/jobs, #/jobs/<id>, #/nodes), over the REST API.
// The token is kept in sessionStorage (gone when the tab closes) and sent as a Bearer token.
// Views poll the API (the job view once a second) and follow the job's log stream (NDJSON).
"use strict";

const TOKEN_KEY = "ftrain.token";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
const LOG_LINES_KEPT = 2000;  // lines kept on the page; older ones are dropped from view
const LOG_TAIL_BYTES = 256 * 1024;  // a job page starts its log this far from the end
const view = document.getElementById("view");
let current = null;  // the view on screen: {stop()} ends its polling and streams

// ------------------------------------------------------------------ API
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  const resp = await fetch("../" + path.replace(/^\//, ""), Object.assign({}, options, { headers }));
  if (resp.status === 401) {  // a first visit (no token yet) is asked for one, neutrally
    showSignIn(headers["Authorization"] ? "Your token was not accepted; sign in again." : "");
    throw new ApiError(401, "unauthorized");
  }
  if (!resp.ok) {
    let detail = resp.statusText;
    try { detail = (await resp.json()).detail || detail; } catch (e) { /* not JSON */ }
    throw new ApiError(resp.status, detail);
  }
  return options.raw ? resp : resp.json();
}

// ------------------------------------------------------------------ formatting
function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function duration(seconds) {
  if (seconds == null || !isFinite(seconds)) return "–";
  seconds = Math.max(0, Math.round(seconds));
  const h = Math.floor(seconds / 3600), m = Math.floor(seconds % 3600 / 60), s = seconds % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(s).padStart(2, "0")}s`;
  return `${s}s`;
}

function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString() : "–"; }
function when(t) { return t ? new Date(t * 1000).toLocaleString() : "–"; }
function bytes(n) {
  if (n == null) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}
function num(v, digits = 4) { return v == null ? "–" : Number(v).toPrecision(digits); }
// The reason under a job's badge: while its group forms (its start: STARTING; a fault:
// RECOVERING; a planned change: RUNNING) until the group's first step, so a RUNNING job that is
// resizing says so; and why a FAILED job failed.
function stateNote(job) {
  if (job.state === "FAILED") return `<br><span class="muted" data-why>${esc(job.reason || "")}</span>`;
  if (!job.regrouping || TERMINAL.has(job.state)) return "";
  return `<br><span class="muted" data-regrouping>${esc(job.reason || "")}</span>`;
}
// Each state has its own colour, fill and sign besides its name, so no two (FAILED and
// CANCELLED above all) are told apart by colour alone; the same badge everywhere.
const STATE_SIGN = {
  PENDING: "○", STARTING: "▷", RUNNING: "▶", RECOVERING: "↻", CANCELLING: "⊘",
  SUCCEEDED: "✓", FAILED: "✕", CANCELLED: "⊘", READY: "●", DRAINING: "◐", DRAINED: "○",
  QUARANTINED: "⚠",
};
function badge(state, text = state) {
  const sign = STATE_SIGN[state] ? `<span class="sign" aria-hidden="true">${STATE_SIGN[state]}</span>` : "";
  return `<span class="state ${esc(state)}" data-state="${esc(state)}">${sign}${esc(text)}</span>`;
}

function jobDuration(job) {
  const end = job.finished_at || Date.now() / 1000;
  return duration(end - job.created_at);
}

// Time left, counted down from the moment the control plane computed it.
function eta(p, job) {
  if (!p || p.eta_s == null || TERMINAL.has(job.state)) return null;
  return Math.max(0, p.eta_s - (Date.now() / 1000 - p.time));
}

// A finished job holds no node: its members are listed on its page, not as in use.
function nodesInUse(job) {
  if (TERMINAL.has(job.state)) return '<span class="muted">–</span>';
  if (!job.nodes.length) return '<span class="muted">0</span>';
  return `${job.nodes.length} <span class="muted mono">${esc(job.nodes.join(", "))}</span>`;
}

function progressCell(job) {
  const p = job.progress;
  if (!p) return `<span class="muted">${TERMINAL.has(job.state) ? "–" : "no steps yet"}</span>`;
  const done = job.state === "SUCCEEDED";
  const pct = p.percent != null ? p.percent : (done ? 100 : null);
  const parts = [`step ${p.step}${p.total_steps ? " / " + p.total_steps : ""}`];
  if (pct != null) parts.push(`${pct.toFixed(pct < 10 ? 1 : 0)}%`);
  const left = eta(p, job);
  if (left != null) parts.push(`ETA ${duration(left)}`);
  const bar = pct != null
    ? `<div class="bar${done ? " done" : ""}" role="progressbar" aria-valuenow="${pct}"><span data-width="${pct}"></span></div>` : "";
  return `<div class="progress">${bar}<span class="label" data-progress>${esc(parts.join(" · "))}</span></div>`;
}

// Where a job's (or every job's) wall time went: one bar, a part per cause (GET .../goodput),
// each part's width its share, and a key with the seconds and the share of each. The parts add
// up to the wall time; causes at 0 s are left out.
function goodputBar(g) {
  const wall = g.wall_s || 0;
  const parts = Object.entries(g.seconds).filter(([, s]) => s > 0);
  if (!wall || !parts.length) return '<span class="muted">no time yet</span>';
  const pct = s => 100 * s / wall;
  const share = s => `${pct(s).toFixed(pct(s) < 10 ? 1 : 0)}%`;
  const bar = parts.map(([c, s]) => `<span class="gp-${esc(c)}" data-cause="${esc(c)}" data-seconds="${s}"
      data-width="${pct(s)}" title="${esc(c)}: ${duration(s)} (${share(s)})"></span>`).join("");
  const key = parts.map(([c, s]) => `<li data-cause="${esc(c)}"><span class="swatch gp-${esc(c)}"></span>${esc(c)}
      <span class="muted">${s < 60 ? s.toFixed(1) + "s" : duration(s)} · ${share(s)}</span></li>`).join("");
  return `<div class="goodput-bar" role="img" aria-label="wall time by cause">${bar}</div>
    <ul class="goodput-key">${key}</ul>`;
}

// The page's Content-Security-Policy takes no inline style (a `style=` attribute in HTML is
// one): a bar's width is set through the DOM, on every bar a view adds.
function sizeBars() {
  for (const el of document.querySelectorAll("[data-width]")) {
    el.style.width = el.dataset.width + "%";
    el.removeAttribute("data-width");
  }
}
new MutationObserver(sizeBars).observe(document.documentElement, { childList: true, subtree: true });

function banner(message) {
  const el = document.getElementById("banner");
  el.textContent = message || "";
  el.hidden = !message;
}

// ------------------------------------------------------------------ sign-in
function showSignIn(message) {
  stopCurrent();
  sessionStorage.removeItem(TOKEN_KEY);
  updateWho();
  view.innerHTML = `
    <form class="panel signin" id="signin">
      <h1>Sign in</h1>
      <p class="muted">Paste your ftrain token: under <span class="mono">ftrain up</span>, the admin's
        is the <span class="mono">token</span> file in its data directory
        (<span class="mono">cat .ftrain/token</span>); a user's comes from
        <span class="mono">ftrain users add NAME</span>. It is kept in this tab only.</p>
      <label for="token">Token</label>
      <input id="token" name="token" type="password" autocomplete="off" required autofocus>
      <button type="submit">Sign in</button>
      <p class="muted" id="signin-error" role="alert">${esc(message || "")}</p>
    </form>`;
  document.getElementById("signin").addEventListener("submit", async ev => {
    ev.preventDefault();
    const given = document.getElementById("token").value.trim();
    const resp = await fetch("../v1/jobs?limit=1", { headers: { Authorization: "Bearer " + given } });
    if (resp.status === 401 || resp.status === 403) {
      document.getElementById("signin-error").textContent = "That token was not accepted.";
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, given);
    updateWho();
    if (!location.hash || location.hash === "#/signin") location.hash = "#/jobs"; else route();
  });
}

function updateWho() {
  const signedIn = !!token();
  document.getElementById("sign-out").hidden = !signedIn;
  document.getElementById("who").textContent = signedIn ? "signed in" : "";
}

document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showSignIn("Signed out.");
});

// ------------------------------------------------------------------ polling
function poll(fn, everyMs) {
  let stopped = false, timer = null;
  const tick = async () => {
    if (stopped) return;
    try { await fn(); banner(""); }
    catch (e) {
      if (e.status === 401) return;  // the sign-in form is shown
      banner(e.status ? e.message : `Could not reach the control plane: ${e.message}`);
    }
    if (!stopped) timer = setTimeout(tick, everyMs);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

function stopCurrent() {
  if (current) current.stop();
  current = null;
}

// ------------------------------------------------------------------ jobs
function jobsView() {
  view.innerHTML = `
    <h1>Jobs</h1>
    <section id="queue-panel" hidden>
      <h2>Queue <span class="muted">(the order waiting jobs will start in)</span></h2>
      <div class="panel"><table id="queue">
        <thead><tr><th>#</th><th>Job</th><th>Owner</th><th>Priority</th><th>Nodes</th><th>Would preempt</th><th>Waiting for</th></tr></thead>
        <tbody></tbody></table></div>
    </section>
    <div class="panel"><h2>Where the time went <span class="muted" id="goodput-jobs"></span></h2>
      <div id="goodput-totals" data-goodput></div></div>
    <div class="panel"><table id="jobs">
      <thead><tr><th>Job</th><th>State</th><th>Progress</th><th>Nodes in use</th><th>Restarts</th>
        <th>Duration</th><th>Owner</th><th>Submitted</th></tr></thead>
      <tbody></tbody></table></div>`;
  const body = view.querySelector("#jobs tbody");
  const stop = poll(async () => {
    await showQueue();
    const items = [];
    let after = null;
    do {  // every page: a shared queue is short; finished jobs expire
      const page = await api(`v1/jobs?limit=500${after ? "&after=" + encodeURIComponent(after) : ""}`);
      items.push(...page.items);
      after = page.next;
    } while (after && items.length < 5000);
    items.reverse();  // newest first
    const totals = await api("v1/goodput");
    view.querySelector("#goodput-totals").innerHTML = goodputBar(totals);
    view.querySelector("#goodput-jobs").textContent =
      `(all jobs: ${totals.jobs}, ${duration(totals.wall_s)} in all)`;
    body.innerHTML = items.length ? items.map(job => `
      <tr data-job="${esc(job.id)}">
        <td><a href="#/jobs/${encodeURIComponent(job.id)}">${esc(job.name)}</a><br><span class="mono muted">${esc(job.id)}</span></td>
        <td>${badge(job.state)}${stateNote(job)}</td>
        <td>${progressCell(job)}</td>
        <td>${nodesInUse(job)}</td>
        <td data-restarts>${restartsCell(job)}</td>
        <td>${jobDuration(job)}</td>
        <td>${esc(job.owner)}</td>
        <td class="muted">${when(job.created_at)}</td>
      </tr>`).join("")
      : `<tr><td colspan="8" class="empty">No jobs yet. Submit one with <span class="mono">ftrain submit job.json</span> or <span class="mono">POST /v1/jobs</span>.</td></tr>`;
  }, 2000);
  return { stop };
}

// The waiting jobs in the scheduler's order (priority, fair share, age), each with why it
// waits: shown above the jobs while any job waits.
async function showQueue() {
  const queue = (await api("v1/queue?limit=50")).items;
  view.querySelector("#queue-panel").hidden = !queue.length;
  view.querySelector("#queue tbody").innerHTML = queue.map(q => `
    <tr data-queued="${esc(q.id)}">
      <td>${q.position}</td>
      <td><a href="#/jobs/${encodeURIComponent(q.id)}">${esc(q.name)}</a><br><span class="mono muted">${esc(q.id)}</span></td>
      <td>${esc(q.owner)}${q.team ? `<br><span class="muted">team ${esc(q.team)}</span>` : ""}</td>
      <td>${q.priority}</td>
      <td>${q.nodes_min}–${q.nodes_max}</td>
      <td data-preempts>${wouldPreempt(q.would_preempt || [])}</td>
      <td class="muted" data-waiting>${esc(q.waiting || "")}</td>
    </tr>`).join("");
}

// A job's restarts in all and by cause (only failures spend max_restarts): "3 (1 failure, 2 preemption)".
const RESTART_CAUSES = { failure: "failure", lost_node: "lost node", preemption: "preemption", resize: "resize" };
function restartsCell(j) {
  const by = j.restarts_by_cause || { failure: j.restarts };
  const parts = Object.entries(RESTART_CAUSES).filter(([c]) => by[c])
    .map(([c, words]) => `<span data-cause="${c}">${by[c]} ${words}</span>`);
  const total = Object.keys(RESTART_CAUSES).reduce((n, c) => n + (by[c] || 0), 0);
  return parts.length ? `${total} <span class="muted">(${parts.join(", ")})</span>` : "0";
}

// The running jobs a waiting one takes nodes from if it is next: how (shrink or suspend), which nodes.
function wouldPreempt(takes) {
  if (!takes.length) return `<span class="muted">–</span>`;
  return takes.map(t => `<a href="#/jobs/${encodeURIComponent(t.job_id)}" class="mono">${esc(t.job_id)}</a>`
    + ` ${t.how === "suspend" ? "suspend" : "shrink"} <span class="mono muted">${esc(t.nodes.join(", "))}</span>`
    + (t.under_way ? ` <span class="muted">(under way)</span>` : "")).join("<br>");
}

// ------------------------------------------------------------------ one job
const PALETTE = ["#1f6fb2", "#d9822b", "#2a9d5b", "#b23a48", "#7b4fb2", "#1b998b", "#8d6e63", "#c2185b"];

// Axis ticks with as many digits as tell them apart (uPlot's default rounds 0.0025 to 0.003).
function ticks(u, splits) {
  const span = Math.abs(splits[splits.length - 1] - splits[0]) || Math.abs(splits[0]) || 1;
  const digits = Math.max(0, Math.min(8, 2 - Math.floor(Math.log10(span / Math.max(1, splits.length - 1)))));
  return splits.map(v => Math.abs(v) >= 1e5 || (v !== 0 && Math.abs(v) < 1e-4) ? v.toExponential(1) : v.toFixed(digits));
}

function makeChart(el, title, names, marks = () => []) {
  const opts = {
    title, width: Math.max(300, el.clientWidth - 4), height: 240,
    scales: { x: { time: false } },
    axes: [{ label: "step" }, { values: ticks, size: 72 }],
    series: [{ label: "step" }, ...names.map((n, i) => ({
      label: n, stroke: PALETTE[i % PALETTE.length], width: 1.6, spanGaps: true,
      points: { show: false }, value: (u, v) => v == null ? "–" : Number(v).toPrecision(5),
    }))],
    legend: { live: true },
    plugins: [marksPlugin(marks)],
  };
  return new uPlot(opts, [[], ...names.map(() => [])], el);
}

function jobView(jobId) {
  view.innerHTML = `
    <h1><span id="job-name">${esc(jobId)}</span> <span id="job-state"></span>
      <span class="spacer"></span><button class="danger" id="cancel" hidden>Cancel job</button></h1>
    <p class="reason" id="job-reason"></p>
    <div class="panel"><div class="facts" id="facts"></div></div>
    <div class="panel"><h2>Where the time went</h2><div id="goodput" data-goodput></div></div>
    <div class="grid">
      <div class="panel"><div class="chart" id="chart-loss" data-chart="loss"></div></div>
      <div class="panel"><div class="chart" id="chart-speed" data-chart="samples_per_s"></div></div>
    </div>
    <div class="panel" id="others-panel" hidden><div class="chart" id="chart-others"></div></div>
    <div class="grid">
      <div class="panel"><h2>Events</h2><ul class="timeline" id="events"></ul></div>
      <div class="panel"><h2>Snapshots</h2><div class="scroll"><table id="snapshots"><thead><tr><th>Step</th><th>Size</th>
        <th>Stall</th><th>Write</th><th>Committed</th><th></th></tr></thead><tbody></tbody></table></div></div>
    </div>
    <div class="panel"><h2>Logs <span class="muted" id="log-state"></span></h2><pre id="log"></pre></div>`;
  const $ = id => document.getElementById(id);
  const charts = {};
  let othersKey = "";
  let job = null;
  let marks = [];  // where the group stopped and re-formed: on every chart (their x is the step)
  const chart = (el, title, names) => makeChart(el, title, names, () => marks);

  $("cancel").addEventListener("click", async () => {
    if (!confirm(`Cancel job ${job ? job.name : jobId}? It snapshots and stops.`)) return;
    $("cancel").disabled = true;
    try { await api(`v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" }); }
    catch (e) { banner(`Cancel failed: ${e.message}`); $("cancel").disabled = false; }
  });

  // Ranks flagged as slower than the others (docs/stragglers.md): node, rank and factor.
  function stragglersCell(j) {
    const s = j.stragglers || [];
    if (!s.length) return `<span class="muted" data-stragglers="0">none</span>`;
    return `<span class="straggler" data-stragglers="${s.length}">` + s.map(x =>
      `<span data-straggler-rank="${x.rank}">rank ${x.rank}${x.node ? ` on ${esc(x.node)}` : ""} ` +
      `(${num(x.factor, 3)}×)</span>`).join(", ") + "</span>";
  }

  function showJob(j) {
    job = j;
    document.title = `${j.name} · ftrain`;
    $("job-name").textContent = j.name;
    $("job-state").innerHTML = badge(j.state);
    $("job-reason").textContent = j.reason || "";
    $("job-reason").dataset.regrouping = j.regrouping ? "1" : "";
    $("cancel").hidden = TERMINAL.has(j.state);
    if (j.state === "CANCELLING") $("cancel").disabled = true;
    const p = j.progress || {};
    const facts = [
      ["Progress", progressCell(j)],
      ["Loss", num(p.loss)],
      ["Samples/s", p.samples_per_s == null ? "–" : Math.round(p.samples_per_s)],
      ["Steps/s", p.steps_per_s == null ? "–" : num(p.steps_per_s, 3)],
      [TERMINAL.has(j.state) ? "Ran on" : "Nodes in use", j.nodes.length ? esc(j.nodes.join(", ")) : "none"],
      ["World size", j.world_size],
      ["Attempt", j.attempt],
      ["Restarts", `<span data-restarts>${restartsCell(j)}</span><br><span class="muted">`
        + `${j.restarts} of ${j.spec.max_restarts} failures allowed</span>`],
      ["Stragglers", stragglersCell(j)],
      ["Duration", jobDuration(j)],
      ["Owner", esc(j.owner)],
      ["Submitted", when(j.created_at)],
      ["Command", `<span class="mono">${esc(j.spec.command.join(" "))}</span>`],
    ];
    $("facts").innerHTML = facts.map(([k, v]) => `<div><span>${k}</span><span>${v}</span></div>`).join("");
  }

  function showMetrics(h) {
    const steps = h.steps;
    const col = name => h.series[name] || steps.map(() => null);
    if (!charts.loss) charts.loss = chart($("chart-loss"), "Loss", ["loss"]);
    if (!charts.speed) charts.speed = chart($("chart-speed"), "Throughput (samples/s)", ["samples_per_s"]);
    charts.loss.setData([steps, col("loss")]);
    charts.speed.setData([steps, col("samples_per_s")]);
    $("chart-loss").dataset.points = steps.length;
    $("chart-speed").dataset.points = steps.length;
    const others = Object.keys(h.series).filter(n => n !== "loss" && n !== "samples_per_s").sort();
    $("others-panel").hidden = !others.length;
    if (!others.length) return;
    if (others.join() !== othersKey) {  // a new scalar appeared: a new chart with every series
      othersKey = others.join();
      if (charts.others) charts.others.destroy();
      $("chart-others").innerHTML = "";
      charts.others = chart($("chart-others"), "Logged scalars", others);
    }
    charts.others.setData([steps, ...others.map(col)]);
  }

  function showEvents(items) {
    $("events").innerHTML = items.slice().reverse().map(e => `
      <li data-event-state="${esc(e.state)}"><span class="muted">${clock(e.time)}</span><span>${badge(e.state)}</span>
        <span>${esc(e.reason)}${e.by ? ` <span class="muted">(by ${esc(e.by)})</span>` : ""}</span></li>`).join("");
  }

  function showSnapshots(list) {
    const body = $("snapshots").querySelector("tbody");
    const items = list.items.slice().reverse();
    body.innerHTML = items.length ? items.map(s => `
      <tr><td>${s.step}</td><td>${bytes(s.size)}</td>
        <td>${s.stall_s == null ? "–" : (s.stall_s * 1000).toFixed(1) + " ms"}</td>
        <td>${s.write_s == null ? "–" : (s.write_s * 1000).toFixed(0) + " ms"}</td>
        <td class="muted">${s.time ? clock(s.time) : ""}</td>
        <td>${s.bad ? badge("FAILED", "corrupt") : s.step === list.latest ? '<span class="muted">latest</span>' : ""}</td></tr>`).join("")
      : `<tr><td colspan="6" class="empty">No snapshot committed yet.</td></tr>`;
  }

  // Logs: follow the NDJSON stream from the last line seen; when it ends (the job ended, or
  // the connection dropped) and the job is still going, follow again from there.
  let logStopped = false, logAbort = null, since = 0;
  const logEl = $("log");
  function appendLines(lines) {
    const atBottom = logEl.scrollTop + logEl.clientHeight >= logEl.scrollHeight - 30;
    const frag = document.createDocumentFragment();
    for (const l of lines) {
      const span = document.createElement("span");
      if (l.stream === "stderr") span.className = "err";
      const who = `[${l.node}${l.rank == null ? "" : " r" + l.rank}${l.attempt ? " a" + l.attempt : ""}] `;
      const meta = document.createElement("span");
      meta.className = "meta"; meta.textContent = who;
      span.append(meta, document.createTextNode(l.line + "\n"));
      frag.append(span);
    }
    logEl.append(frag);
    while (logEl.childNodes.length > LOG_LINES_KEPT) logEl.firstChild.remove();
    if (atBottom) logEl.scrollTop = logEl.scrollHeight;
  }
  async function followLogs() {
    try {  // start near the end: a job's log may be many MiB
      const page = await api(`v1/jobs/${encodeURIComponent(jobId)}/logs?limit=1`);
      since = Math.max(page.first_seq, page.end_seq - LOG_TAIL_BYTES);
      if (since > page.first_seq) {
        const note = document.createElement("span");
        note.className = "meta";
        note.textContent = `(${bytes(since - page.first_seq)} of earlier output not shown: ` +
                           `GET /v1/jobs/${jobId}/logs has it all)\n`;
        logEl.append(note);
      }
    } catch (e) { /* followed from the start below */ }
    while (!logStopped) {
      logAbort = new AbortController();
      $("log-state").textContent = "following";
      try {
        const resp = await api(`v1/jobs/${encodeURIComponent(jobId)}/logs?follow=true&wait_s=30&since=${since}`,
                               { raw: true, signal: logAbort.signal });
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let rest = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          rest += decoder.decode(value, { stream: true });
          const parts = rest.split("\n");
          rest = parts.pop();
          const lines = parts.filter(Boolean).map(s => JSON.parse(s));
          if (lines.length) {
            since = lines[lines.length - 1].seq + 1;
            appendLines(lines);
          }
        }
      } catch (e) {
        if (logStopped || e.status === 404 || e.status === 401) return;  // no such job, or signed out
      }
      if (job && TERMINAL.has(job.state)) { $("log-state").textContent = "(the job has ended)"; return; }
      await new Promise(r => setTimeout(r, 1000));
    }
  }

  const id = encodeURIComponent(jobId);
  const stopPoll = poll(async () => {
    const [j, events, metrics, snaps, goodput] = await Promise.all([
      api(`v1/jobs/${id}`), api(`v1/jobs/${id}/events`), api(`v1/jobs/${id}/metrics`),
      api(`v1/jobs/${id}/snapshots`), api(`v1/jobs/${id}/goodput`)]);
    marks = regroupMarks(events.items, metrics);
    showJob(j); showEvents(events.items); showMetrics(metrics); showSnapshots(snaps);
    $("goodput").innerHTML = goodputBar(goodput);
  }, 1000);
  followLogs();
  const onResize = () => {
    for (const [name, chart] of Object.entries(charts)) {
      const el = { loss: $("chart-loss"), speed: $("chart-speed"), others: $("chart-others") }[name];
      if (el) chart.setSize({ width: Math.max(300, el.clientWidth - 4), height: 240 });
    }
  };
  window.addEventListener("resize", onResize);
  return {
    stop() {
      stopPoll(); logStopped = true; if (logAbort) logAbort.abort();
      window.removeEventListener("resize", onResize);
      for (const c of Object.values(charts)) c.destroy();
    },
  };
}

// ------------------------------------------------------------------ nodes
// A node's GPUs as `ftrain nodes` writes them: "2 x NVIDIA H100 80GB HBM3", or "-" for none.
function gpusCell(n) {
  return n.gpus ? `${n.gpus} x ${esc(n.gpu_model || "GPU")}` : '<span class="muted">-</span>';
}

function nodesView() {
  view.innerHTML = `
    <h1>Nodes</h1>
    <div class="panel"><table id="nodes">
      <thead><tr><th>Node</th><th>State</th><th>Workers</th><th>GPUs</th><th>Job</th><th>Address</th><th>Registered</th><th></th></tr></thead>
      <tbody></tbody></table></div>`;
  const body = view.querySelector("#nodes tbody");
  body.addEventListener("click", async ev => {
    const { drain, undrain } = ev.target.dataset;
    const name = drain || undrain;
    if (!name) return;
    if (drain && !confirm(`Drain node ${name}? Its job snapshots and goes on without it.`)) return;
    const verb = drain ? "drain" : "undrain";
    ev.target.disabled = true;
    try { await api(`v1/nodes/${encodeURIComponent(name)}/${verb}`, { method: "POST" }); }
    catch (e) { banner(`${drain ? "Drain" : "Undrain"} failed: ${e.message}`); ev.target.disabled = false; }
  });
  const stop = poll(async () => {
    const nodes = (await api("v1/nodes")).items;
    body.innerHTML = nodes.length ? nodes.map(n => `
      <tr data-node="${esc(n.name)}">
        <td class="mono">${esc(n.name)}</td><td>${badge(n.state)}${n.reason
          ? `<br><span class="muted" data-reason>${esc(n.reason)}</span>` : ""}</td><td>${n.nproc_per_node}</td>
        <td data-gpus>${gpusCell(n)}</td>
        <td>${n.job ? `<a href="#/jobs/${encodeURIComponent(n.job)}">${esc(n.job)}</a> <span class="muted">${esc(n.member_state || "")}</span>`
          : n.held_for ? `<span class="muted">held for</span> <a href="#/jobs/${encodeURIComponent(n.held_for)}">${esc(n.held_for)}</a>`
          : '<span class="muted">idle</span>'}</td>
        <td class="mono muted">${esc(n.address || "–")}</td><td class="muted">${when(n.registered_at)}</td>
        <td>${n.state === "READY" ? `<button data-drain="${esc(n.name)}">Drain</button>`
            : ["DRAINING", "DRAINED", "QUARANTINED"].includes(n.state) ? `<button data-undrain="${esc(n.name)}">Undrain</button>` : ""}</td>
      </tr>`).join("")
      : `<tr><td colspan="8" class="empty">No nodes. Start one with <span class="mono">ftrain node --server URL</span>.</td></tr>`;
  }, 2000);
  return { stop };
}

// ------------------------------------------------------------------ routing
function route() {
  stopCurrent();
  banner("");
  const hash = location.hash || "#/jobs";
  const job = hash.match(/^#\/jobs\/([^/]+)$/);
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", hash.startsWith("#/" + a.dataset.nav));
  }
  if (job) current = jobView(decodeURIComponent(job[1]));
  else if (hash.startsWith("#/nodes")) current = nodesView();
  else current = jobsView();
}

window.addEventListener("hashchange", route);
updateWho();
route();
