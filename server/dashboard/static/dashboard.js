// proxrl dashboard: live refresh of server-rendered sections, the run page's charts (Plotly,
// served by this server from the installed plotly package), and the token viewer's colours.
"use strict";

const POLL_MS = 5000;

// ----- live sections: re-fetch this page and swap in the fresh [data-live] blocks ------------

async function refreshLive() {
  const live = document.querySelectorAll("[data-live]");
  if (!live.length) return;
  const reply = await fetch(location.href, { credentials: "same-origin" });
  if (reply.redirected || !reply.ok) return;
  const fresh = new DOMParser().parseFromString(await reply.text(), "text/html");
  for (const block of live) {
    const next = fresh.querySelector(`[data-live="${block.dataset.live}"]`);
    if (next) block.innerHTML = next.innerHTML;
  }
}

// ----- run page charts ------------------------------------------------------------------------

const COLOURS = ["#3b5bdb", "#e8590c", "#2b8a3e", "#ae3ec9", "#c92a2a", "#0c8599"];
const state = { steps: [], series: null, axis: "time" };

function metric(step, name) {
  const value = step.metrics[name];
  return typeof value === "number" ? value : null;
}

function versionAt(time) {
  // the policy version served at `time`: the last step published before it
  const steps = state.steps;
  let version = steps.length ? Math.max(0, steps[0].version - 1) : 0;
  for (const step of steps) {
    if (step.time > time) break;
    version = step.version;
  }
  return version;
}

function stepX(step) {
  return state.axis === "version" ? step.version : new Date(step.time * 1000);
}

function line(name, steps, value, extra = {}) {
  const points = steps.map((s, i) => [stepX(s), value(s, i)]).filter(([, y]) => y !== null && isFinite(y));
  return { name, x: points.map((p) => p[0]), y: points.map((p) => p[1]), mode: "lines+markers", type: "scatter", ...extra };
}

function perSecond(steps, value) {
  // a per-step amount divided by the time since the previous step
  return steps.map((s, i) => {
    if (i === 0) return null;
    const dt = s.time - steps[i - 1].time;
    const amount = value(s);
    return dt > 0 && amount !== null ? amount / dt : null;
  });
}

function byVersion(points, combine) {
  // server-side time buckets grouped by the policy version served at their middle
  const half = state.series.bucket_seconds / 2;
  const groups = new Map();
  for (const point of points) {
    const version = versionAt(point.time + half);
    if (!groups.has(version)) groups.set(version, []);
    groups.get(version).push(point);
  }
  return [...groups.entries()].sort((a, b) => a[0] - b[0]).map(([v, group]) => ({ x: v, ...combine(group) }));
}

function rewardBuckets() {
  const rewards = state.series.rewards;
  if (state.axis === "time") {
    return rewards.map((r) => ({ x: new Date(r.time * 1000), mean: r.mean, std: r.std }));
  }
  return byVersion(rewards, (group) => {
    const n = group.reduce((a, r) => a + r.count, 0);
    const mean = group.reduce((a, r) => a + r.mean * r.count, 0) / n;
    const square = group.reduce((a, r) => a + (r.std * r.std + r.mean * r.mean) * r.count, 0) / n;
    return { mean, std: Math.sqrt(Math.max(square - mean * mean, 0)) };
  });
}

function sessionBuckets(field) {
  const width = state.series.bucket_seconds;
  const points = state.series.sessions;
  if (state.axis === "time") {
    return points.map((p) => ({ x: new Date(p.time * 1000), y: p[field], rate: p[field] / width }));
  }
  return byVersion(points, (group) => {
    const total = group.reduce((a, p) => a + p[field], 0);
    return { y: total, rate: total / (group.length * width) };
  });
}

function band(steps) {
  // the batch's reward spread: min..max when known, else mean ± std
  const lower = [], upper = [], xs = [];
  for (const s of steps) {
    const mean = metric(s, "reward_mean");
    if (mean === null) continue;
    let low = metric(s, "reward_min"), high = metric(s, "reward_max");
    const std = metric(s, "reward_std");
    if (low === null || high === null) {
      if (std === null) continue;
      [low, high] = [mean - std, mean + std];
    }
    xs.push(stepX(s)); lower.push(low); upper.push(high);
  }
  if (!xs.length) return [];
  return [
    { x: xs, y: upper, mode: "lines", line: { width: 0 }, showlegend: false, hoverinfo: "skip", type: "scatter" },
    { x: xs, y: lower, mode: "lines", line: { width: 0 }, fill: "tonexty", fillcolor: "rgba(59,91,219,0.15)",
      name: "batch spread", type: "scatter" },
  ];
}

function evalTraces() {
  // eval sessions' rewards by the policy version that answered: one line per task, then all
  const figures = state.series.eval;
  const byTask = new Map();
  for (const f of figures.tasks) {
    const name = f.task_id === null ? "no task" : `task ${f.task_id}`;
    if (!byTask.has(name)) byTask.set(name, []);
    byTask.get(name).push(f);
  }
  const hover = "v%{x}: %{y:.3f} (%{customdata} sessions)<extra>%{fullData.name}</extra>";
  const trace = (name, points, extra) => ({
    name, x: points.map((p) => p.version), y: points.map((p) => p.mean),
    customdata: points.map((p) => p.count), hovertemplate: hover,
    mode: "lines+markers", type: "scatter", ...extra,
  });
  const traces = [...byTask.entries()].map(([name, points], i) =>
    trace(name, points, { line: { color: COLOURS[(i + 1) % COLOURS.length] } }));
  if (figures.versions.length) {
    traces.push(trace("all tasks (± std)", figures.versions, {
      line: { color: COLOURS[0], width: 3 },
      error_y: { type: "data", array: figures.versions.map((p) => p.std), visible: true, color: "#3b5bdb55" },
    }));
  }
  return traces;
}

function charts() {
  const steps = state.steps;
  const series = state.series;
  const swaps = series.swaps;
  const mismatchKeys = [...new Set(steps.flatMap((s) => Object.keys(s.metrics).filter((k) => k.includes("mismatch"))))];
  const histogram = [];
  for (const s of steps) {
    (s.metrics.staleness_histogram || []).forEach((count, behind) => {
      histogram[behind] = (histogram[behind] || 0) + (count || 0);
    });
  }
  const rewards = rewardBuckets();
  const ended = sessionBuckets("ended");
  const breaks = sessionBuckets("breaks");
  const turns = sessionBuckets("turns");
  const trainedPerSecond = perSecond(steps, (s) => metric(s, "trained_tokens"));
  const sessionsPerSecond = perSecond(steps, (s) => metric(s, "sessions"));
  const swapX = (w) => (state.axis === "version" ? w.version : new Date(w.time * 1000));
  return {
    reward: {
      traces: [
        ...band(steps),
        line("trainer batch mean", steps, (s) => metric(s, "reward_mean"), { line: { color: COLOURS[0] } }),
        { name: "session rewards (mean ± std)", x: rewards.map((r) => r.x), y: rewards.map((r) => r.mean),
          error_y: { type: "data", array: rewards.map((r) => r.std), visible: true, color: "#e8590c55" },
          mode: "markers", type: "scatter", marker: { color: COLOURS[1] } },
      ],
      empty: "No rewards yet: post them with POST /rl/sessions/{id}/reward.",
    },
    eval: {
      traces: evalTraces(),
      layout: { xaxis: { type: "linear", title: { text: "policy version" }, dtick: 1 },
        yaxis: { title: { text: "reward" } } },
      empty: 'No rewarded eval sessions yet: create sessions with "eval": true (POST /rl/sessions) and reward them.',
    },
    throughput: {
      traces: [
        line("effective (trained tokens / wall time between steps)", steps, (s, i) => trainedPerSecond[i]),
        line("while training and publishing", steps, (s) => metric(s, "tokens_per_second")),
      ],
      empty: "No trainer steps yet.",
    },
    sessions: {
      traces: [
        line("trained sessions/s", steps, (s, i) => sessionsPerSecond[i]),
        { name: "sessions ended/s (agents)", x: ended.map((p) => p.x), y: ended.map((p) => p.rate), type: "scatter", mode: "lines+markers" },
      ],
      empty: "No sessions yet.",
    },
    staleness: {
      traces: [
        line("mean", steps, (s) => metric(s, "staleness_mean")),
        line("max", steps, (s) => metric(s, "staleness_max"), { line: { dash: "dot" } }),
      ],
      empty: "No trainer steps yet.",
    },
    "trained-share": {
      traces: [
        line("this step", steps, (s) => metric(s, "trained_share")),
        line("the run so far", steps, (s) => metric(s, "total_trained_share"), { line: { width: 3 } }),
        ...(steps.length && series.min_trained_share !== null ? [{
          name: "min_trained_share", x: [stepX(steps[0]), stepX(steps[steps.length - 1])],
          y: [series.min_trained_share, series.min_trained_share],
          mode: "lines", type: "scatter", line: { dash: "dot", color: COLOURS[4] },
        }] : []),
      ],
      layout: { yaxis: { range: [0, 1.05], tickformat: ".0%" } },
      empty: steps.length ? "The trainer does not report a trained share." : "No trainer steps yet.",
      hasData: steps.some((s) => metric(s, "trained_share") !== null),
    },
    "staleness-histogram": {
      traces: histogram.length ? [{ type: "bar", name: "tokens", x: histogram.map((_, i) => i), y: histogram.map((c) => c || 0) }] : [],
      layout: { xaxis: { type: "linear", title: { text: "versions behind" }, dtick: 1 } },
      empty: "No staleness histogram reported yet.",
    },
    behaviour: {
      traces: [
        line("behaviour weight mean (π_prox / π_behav)", steps, (s) => metric(s, "behaviour_weight_mean")),
        line("clip fraction", steps, (s) => metric(s, "clip_fraction")),
        line("behaviour-masked fraction", steps, (s) => metric(s, "behaviour_masked_fraction")),
      ],
      empty: "No trainer steps yet.",
    },
    mismatch: {
      traces: [
        ...mismatchKeys.map((key) => line(key, steps, (s) => metric(s, key))),
        // turns sampled at another temperature than the training one: never in the mismatch
        line("off-temperature share, masked", steps, (s) => metric(s, "off_temperature_masked_fraction"),
          { yaxis: "y2", line: { dash: "dot" } }),
        line("off-temperature share, trained off-policy", steps, (s) => metric(s, "off_policy_fraction"),
          { yaxis: "y2", line: { dash: "dash" } }),
      ],
      layout: { yaxis: { title: { text: "nats" } },
        yaxis2: { overlaying: "y", side: "right", range: [0, 1], title: { text: "share of sampled tokens" } } },
      empty: steps.length
        ? "The trainer does not report an engine-vs-trainer logprob mismatch (a metric named *mismatch*)."
        : "No trainer steps yet.",
      hasData: mismatchKeys.length > 0,
    },
    breaks: {
      traces: [
        { name: "prefix breaks", type: "bar", x: breaks.map((p) => p.x), y: breaks.map((p) => p.y),
          width: state.axis === "time" ? series.bucket_seconds * 1000 : undefined, offset: state.axis === "time" ? 0 : undefined },
        { name: "turns", type: "scatter", mode: "lines+markers", x: turns.map((p) => p.x), y: turns.map((p) => p.y), yaxis: "y2" },
      ],
      layout: { yaxis2: { overlaying: "y", side: "right", title: { text: "turns" } } },
      empty: "No sessions yet.",
      hasData: turns.length > 0,
    },
    swaps: {
      traces: [
        { name: "pause (server, this process)", type: "scatter", mode: "markers", x: swaps.map(swapX), y: swaps.map((w) => w.pause_seconds) },
        line("publish (trainer)", steps, (s) => metric(s, "publish_seconds")),
      ],
      layout: { yaxis: { title: { text: "seconds" } } },
      empty: "No weight swaps yet.",
    },
    loss: {
      traces: [
        line("loss", steps, (s) => metric(s, "loss")),
        line("grad norm", steps, (s) => metric(s, "grad_norm"), { yaxis: "y2" }),
      ],
      layout: { yaxis2: { overlaying: "y", side: "right" } },
      empty: "No trainer steps yet.",
    },
  };
}

function draw() {
  const newest = state.steps.length ? state.steps[state.steps.length - 1].version : 0;
  const xaxis = state.axis === "version" ? { dtick: newest <= 20 ? 1 : undefined } : { type: "date" };
  for (const [id, chart] of Object.entries(charts())) {
    const section = document.querySelector(`[data-chart="${id}"]`);
    const plot = section.querySelector(".plot");
    const note = section.querySelector(".note");
    const hasData = chart.hasData ?? chart.traces.some((t) => t.x && t.x.length);
    note.hidden = hasData;
    note.textContent = hasData ? "" : chart.empty;
    section.dataset.drawn = hasData ? "yes" : "empty";
    const layout = {
      margin: { l: 45, r: 45, t: 8, b: 30 }, showlegend: true,
      legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", font: { size: 11 } },
      xaxis, ...chart.layout,
    };
    if (chart.layout && chart.layout.xaxis) layout.xaxis = { ...xaxis, ...chart.layout.xaxis };
    plot.hidden = !hasData;
    if (hasData) Plotly.react(plot, chart.traces, layout, { displaylogo: false, responsive: true });
    else Plotly.purge(plot);
  }
}

async function loadSeries(root, full) {
  const after = full || !state.steps.length ? 0 : state.steps[state.steps.length - 1].step;
  const reply = await fetch(`/admin/api/runs/${root.dataset.runId}/series?after_step=${after}`, { credentials: "same-origin" });
  if (!reply.ok) return;
  const series = await reply.json();
  state.steps = after ? state.steps.concat(series.steps) : series.steps;
  state.series = series;
  if (series.step_count > state.steps.length && !full && series.step_count <= 2000) {
    return loadSeries(root, true);  // a step was replaced or missed: start again
  }
  draw();
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function runPage(root) {
  for (const radio of document.querySelectorAll('input[name="axis"]')) {
    radio.addEventListener("change", () => { state.axis = radio.value; draw(); });
  }
  loadSeries(root, true);
  setInterval(() => { loadSeries(root, false).catch(() => {}); refreshLive().catch(() => {}); }, POLL_MS);
}

// ----- token viewer ------------------------------------------------------------------------

function versionColour(version) {
  return `hsl(${(200 + Number(version) * 67) % 360},70%,82%)`;
}

function versionLegend() {
  // one swatch per policy version among the trained tokens
  const legend = document.getElementById("legend-version");
  const versions = new Set();
  for (const token of document.querySelectorAll('.tok[data-mask="1"]')) versions.add(Number(token.dataset.version));
  legend.replaceChildren(...[...versions].sort((a, b) => a - b).map((version) => {
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = versionColour(version);
    swatch.textContent = `v${version}`;
    return swatch;
  }));
}

function colourTokens(mode) {
  for (const token of document.querySelectorAll(".tok")) {
    const { logprob, version, mask } = token.dataset;
    if (mask === "0") {
      token.style.background = "#e9e9ee"; token.style.color = "#777";
      continue;
    }
    token.style.color = "";
    if (mode === "version") {
      token.style.background = versionColour(version);
    } else if (mode === "mask") {
      token.style.background = "hsl(120,55%,80%)";
    } else {
      token.style.background = `hsl(${Math.round(120 * Math.exp(Math.min(Number(logprob), 0)))},70%,82%)`;
    }
  }
  document.getElementById("legend-logprob").hidden = mode !== "logprob";
  document.getElementById("legend-version").hidden = mode !== "version";
  document.getElementById("legend-mask").hidden = mode !== "mask";
  if (mode === "version") versionLegend();
}

// ----- start ---------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  const charts = document.getElementById("charts");
  if (charts) runPage(charts);
  else if (document.querySelector("[data-live]")) setInterval(() => refreshLive().catch(() => {}), POLL_MS);
  for (const radio of document.querySelectorAll('input[name="colour"]')) {
    radio.addEventListener("change", () => colourTokens(radio.value));
  }
});
