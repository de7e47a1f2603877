// ftrain dashboard: the marks on a job's curves where its group stopped and re-formed. Pure
// functions from the job's events and metric history to marks (regroupMarks), and a uPlot
// plugin that shows them (marksPlugin); loaded before app.js, which draws the charts.
"use strict";

// Where the job's group stopped and re-formed, read from its events. A regroup opens at the
// first event of a cause (a node joining, a drain, a lost node, a fault: the move to
// RECOVERING, a new attempt) and closes when training goes on ("training again"); causes
// within it (a lost node's restart, the new attempt that follows a drain) are one mark. Events
// carry a time, the curves a step: a mark stands at the newest point the metric history had
// when its regroup opened (its `times` beside its `steps`), where the curve stopped.
const MARK_KINDS = [
  { kind: "scale-up", sign: "+", label: "scale-up", is: e => /^node\(s\) .* joined; scaling up/.test(e.reason) },
  { kind: "drain", sign: "−", label: "drain", is: e => /^node\(s\) .* drained; /.test(e.reason) },
  { kind: "lost", sign: "✕", label: "node lost", is: e => /^node(\(s\))? [^:;(]* lost\b/.test(e.reason) },
  { kind: "restart", sign: "↻", label: "restart", is: (e, before) => e.state === "RECOVERING" && before !== "RECOVERING" },
  { kind: "attempt", sign: "#", label: "new attempt", is: e => /^attempt ([2-9]|\d{2,}) /.test(e.reason) },
];
const TRAINING = /^training\b/;  // "training: ..." (the first step), "training again: ..."

// The step of the newest point at or before `time`, or null before the first point.
function stepAt(history, time) {
  let i = history.times.length - 1;
  while (i >= 0 && history.times[i] > time) i--;
  return i < 0 ? null : history.steps[i];
}

// The marks: {step, kind, events}, its kind its first cause's, its events the regroup's (the
// causes, what followed, the training again that closed it).
function regroupMarks(events, history) {
  const marks = [];
  let open = null, before = null;
  for (const e of events) {
    const found = MARK_KINDS.find(k => k.is(e, before));
    before = e.state;
    if (!open && found) {
      const step = stepAt(history, e.time);
      if (step == null) continue;  // before the first point: nothing on the curve to mark
      const last = marks[marks.length - 1];
      open = last && last.step === step ? last : { step, kind: found.kind, events: [] };
      if (open !== last) marks.push(open);
    }
    if (open) open.events.push(e);
    if (TRAINING.test(e.reason)) open = null;
  }
  return marks;
}

function markTitle(m) {
  const lines = m.events.map(e => `${new Date(e.time * 1000).toLocaleTimeString()} ${e.reason}`);
  return `${MARK_KINDS.find(k => k.kind === m.kind).label} at step ${m.step}\n${lines.join("\n")}`;
}

// A uPlot plugin that draws `marks()` as vertical lines over the plot, each with its cause's
// sign on a flag (its title names the events), and a key of the causes under the chart. They
// are elements, not canvas strokes, so a pointer or a screen reader finds them; their places
// are set through the DOM, as the page's policy asks.
function marksPlugin(marks) {
  return { hooks: { draw: u => placeMarks(u, marks()) } };
}

function placeMarks(u, marks) {
  const layer = child(u.over, "marks");
  const { min, max } = u.scales.x;
  layer.replaceChildren(...marks.filter(m => m.step >= min && m.step <= max).map(m => {
    const el = document.createElement("div");
    const kind = MARK_KINDS.find(k => k.kind === m.kind);
    el.className = `mark ${m.kind}`;
    el.dataset.kind = m.kind;
    el.dataset.step = m.step;
    el.title = markTitle(m);
    el.setAttribute("role", "img");
    el.setAttribute("aria-label", el.title);
    el.style.left = `${u.valToPos(m.step, "x")}px`;
    const flag = document.createElement("span");
    flag.className = "flag";
    flag.textContent = kind.sign;
    el.append(flag);
    return el;
  }));
  const key = child(u.root, "mark-key");
  const counts = new Map();
  for (const m of marks) counts.set(m.kind, (counts.get(m.kind) || 0) + 1);
  key.replaceChildren(...MARK_KINDS.filter(k => counts.has(k.kind)).map(k => {
    const item = document.createElement("span");
    item.className = `mark-key-item ${k.kind}`;
    const flag = document.createElement("span");
    flag.className = "flag";
    flag.textContent = k.sign;
    const n = counts.get(k.kind);
    item.append(flag, `${k.label}${n > 1 ? " ×" + n : ""}`);
    return item;
  }));
}

function child(parent, className) {
  let el = parent.querySelector(`:scope > .${className}`);
  if (!el) {
    el = document.createElement("div");
    el.className = className;
    parent.append(el);
  }
  return el;
}
