/* gatelens report page: the analysis windows coloured by one unit's signal, a sortable
   unit list, and the perturbation view. Vanilla JS, no network, data from #gl-data.
   Quantised arrays decode as v = lo[u] + q / 255 * (hi[u] - lo[u]) (html_data.py). */
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("gl-data").textContent);
  const M = D.meta, T = M.length, P = D.perturb;
  // the unit the model reads (characters, tokens, bytes) and its singular
  const UNIT = M.unit || "characters", UNIT1 = UNIT.replace(/s$/, "");
  const $ = (id) => document.getElementById(id);
  const SVGNS = "http://www.w3.org/2000/svg";
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- decoding -------------------------------------------------------------------
  const cache = new Map();
  function bytes(enc) {
    let a = cache.get(enc);
    if (!a) {
      const s = atob(enc.q);
      a = new Uint8Array(s.length);
      for (let i = 0; i < s.length; i++) a[i] = s.charCodeAt(i);
      cache.set(enc, a);
    }
    return a;
  }
  function val(enc, row, u) {  // enc holds (rows, S) in C order
    const S = enc.shape[enc.shape.length - 1];
    if (u >= S) return NaN;
    return enc.lo[u] + bytes(enc)[row * S + u] / 255 * (enc.hi[u] - enc.lo[u]);
  }

  // ---- colour -----------------------------------------------------------------------
  const SEQ = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const DIV = [[33, 102, 172], [103, 169, 207], [247, 247, 247], [239, 138, 98], [178, 24, 43]];
  function ramp(stops, x) {
    x = Math.min(1, Math.max(0, isFinite(x) ? x : 0.5));
    const k = x * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(k)), f = k - i;
    return [0, 1, 2].map((j) => Math.round(stops[i][j] + (stops[i + 1][j] - stops[i][j]) * f));
  }
  function paint(e, rgb) {
    e.style.backgroundColor = "rgb(" + rgb.join(",") + ")";
    e.style.color = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 145 ? "#111" : "#fff";
  }
  function gradient(stops) {
    return "linear-gradient(to right," + stops.map((c) => "rgb(" + c.join(",") + ")").join(",") + ")";
  }
  const fmt = (v, d) => (v === null || v === undefined || Number.isNaN(v)) ? "—"
    : !isFinite(v) ? "∞" : (Math.abs(v) < 1e-3 && v !== 0 ? v.toExponential(2) : v.toFixed(d === undefined ? 3 : d));
  const tick = (v, span) => {  // as many decimals as the axis span needs, no more
    const d = Math.max(0, Math.min(8, 1 - Math.floor(Math.log10(span / 4))));
    return Math.abs(v) < span * 1e-6 ? "0" : v.toFixed(d);
  };
  const signed = (v) => (v > 0 ? "+" : "") + fmt(v);
  const shown1 = (c) => c === "\n" ? "↵\n" : c === "\t" ? "⇥" : c < " " ? "·" : c;
  // a character as before; a token character by character, so its newlines show too
  const shown = (c) => c.length <= 1 ? shown1(c) : Array.from(c).map(shown1).join("");
  const quote = (c) => JSON.stringify(c);

  // ---- state ----------------------------------------------------------------------------
  const hasKeep = !!M.keep_gate;
  const S = {
    layer: M.layers[0], signal: M.signals.includes(M.keep_gate) ? M.keep_gate : M.signals[M.signals.length - 1],
    model: "trained", unit: 0, key: hasKeep ? "half_life" : "mean", desc: true, order: [],
    pwin: 0, pmode: "unit", range: "fixed",
  };
  const U = () => D.units[S.layer];
  const H = () => U().mean.length;
  function key(u, k) {
    if (k === "unit") return u;
    const v = U()[k][u];
    if (k === "half_life") return v === null ? (hasKeep ? Infinity : -Infinity) : v;
    return v === null ? -Infinity : v;
  }

  // ---- unit list ------------------------------------------------------------------------
  const COLS = [["unit", "unit"], ["mean", hasKeep ? "mean " + M.keep_gate : "mean h"], ["init", "at init"],
    ["shift", "shift"]].concat(hasKeep ? [["half_life", "t½"]] : []);
  let rows = [];
  function buildUnits() {
    const head = $("unithead"), body = document.querySelector("#units tbody");
    head.textContent = ""; body.textContent = "";
    for (const [k, label] of COLS) {
      const th = el("th", k === S.key ? (S.desc ? "sorted desc" : "sorted asc") : "", label);
      th.dataset.key = k; th.tabIndex = 0; th.title = "sort by " + label;
      head.appendChild(th);
    }
    rows = [];
    for (let u = 0; u < H(); u++) {
      const tr = el("tr");
      tr.dataset.unit = u;
      const d = U();
      [u, d.mean[u], d.init[u], d.shift[u]].forEach((v, j) => {
        tr.appendChild(el("td", "", j === 0 ? String(v) : j === 3 ? signed(v) : fmt(v)));
      });
      if (hasKeep) tr.appendChild(el("td", "", d.half_life[u] === null ? "∞" : fmt(d.half_life[u], 2)));
      if (hasKeep) paint(tr.children[1], ramp(SEQ, d.mean[u]));
      rows.push(tr);
    }
    sortUnits();
  }
  function sortUnits() {
    const sgn = S.desc ? -1 : 1;
    S.order = rows.map((_, u) => u).sort((a, b) => sgn * (key(a, S.key) - key(b, S.key)) || a - b);
    const body = document.querySelector("#units tbody");
    for (const u of S.order) body.appendChild(rows[u]);
    for (const th of $("unithead").children) {
      th.className = th.dataset.key === S.key ? (S.desc ? "sorted desc" : "sorted asc") : "";
    }
  }
  $("unithead").addEventListener("click", (ev) => {
    const k = ev.target.dataset && ev.target.dataset.key;
    if (!k) return;
    S.desc = k === S.key ? !S.desc : k !== "unit";
    S.key = k;
    sortUnits();
    rows[S.unit].scrollIntoView({ block: "nearest" });
  });
  document.querySelector("#units tbody").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr");
    if (tr) pick(+tr.dataset.unit);
  });
  document.addEventListener("keydown", (ev) => {
    const tag = ev.target && ev.target.tagName;
    if (tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA") return;
    const step = { ArrowDown: 1, ArrowRight: 1, ArrowUp: -1, ArrowLeft: -1 }[ev.key];
    if (!step) return;
    ev.preventDefault();
    const i = S.order.indexOf(S.unit);
    pick(S.order[Math.min(S.order.length - 1, Math.max(0, i + step))]);
  });

  // ---- buttons ----------------------------------------------------------------------------
  function buttons(box, items, current, onpick) {
    box.textContent = "";
    for (const [value, label, tip] of items) {
      const b = el("button", "", label);
      b.type = "button"; b.dataset.value = value; b.title = tip || label;
      b.setAttribute("aria-pressed", String(value === current));
      b.addEventListener("click", () => {
        for (const o of box.children) o.setAttribute("aria-pressed", String(o === b));
        onpick(value);
      });
      box.appendChild(b);
    }
  }

  // ---- text view ------------------------------------------------------------------------
  let spans = [];
  function buildWindows() {
    const box = $("windows");
    box.textContent = "";
    spans = [];
    D.texts.forEach((txt, w) => {
      const wrap = el("div", "win");
      wrap.appendChild(el("div", "wlab", "window " + (w + 1)));
      const line = el("div", UNIT === "characters" ? "chars" : "chars toks");
      Array.from(txt).forEach((c, t) => {
        const s = el("span", "ch", shown(c));
        s._w = w; s._t = t; s._c = c;
        line.appendChild(s);
        spans.push(s);
      });
      wrap.appendChild(line);
      box.appendChild(wrap);
    });
    $("wincount").textContent = "Showing " + D.texts.length + " of " + M.n_windows +
      " analysis windows of " + T + " " + UNIT + (M.source ? " from " + M.source : "") +
      "; the tables and plots use all " + M.n_windows + ".";
  }
  function extent(sig, u) {  // this unit's [min, max] over both models' shown windows
    let lo = Infinity, hi = -Infinity;
    for (const lab of ["trained", "untrained"]) {
      const enc = D.models[lab][S.layer][sig];
      if (enc) { lo = Math.min(lo, enc.lo[u]); hi = Math.max(hi, enc.hi[u]); }
    }
    return hi > lo ? [lo, hi] : [lo - 0.5, lo + 0.5];
  }
  function scale(sig, u) {  // value -> rgb for this signal and unit, same for both models
    const r = M.ranges[sig];
    if (S.range === "unit") {
      const [lo, hi] = extent(sig, u), st = r && r[0] === 0 ? SEQ : DIV;
      return { stops: st, lo: lo, hi: hi, f: (v) => ramp(st, (v - lo) / (hi - lo)) };
    }
    if (r && r[0] === 0) return { stops: SEQ, lo: 0, hi: 1, f: (v) => ramp(SEQ, v) };
    let m = 1;
    if (!r) {
      m = 0;
      for (const lab of ["trained", "untrained"]) {
        const enc = D.models[lab][S.layer][sig];
        if (enc) m = Math.max(m, Math.abs(enc.lo[u]), Math.abs(enc.hi[u]));
      }
      m = m || 1;
    }
    return { stops: DIV, lo: -m, hi: m, f: (v) => ramp(DIV, (v / m + 1) / 2) };
  }
  function legend(prefix, sc, unit) {
    $(prefix + "bar").style.background = gradient(sc.stops);
    $(prefix + "lo").textContent = fmt(sc.lo, 2) + (unit || "");
    $(prefix + "hi").textContent = fmt(sc.hi, 2) + (unit || "");
  }
  function recolor() {
    const enc = D.models[S.model][S.layer][S.signal], u = S.unit;
    const sc = scale(S.signal, u);
    for (const s of spans) {
      const v = val(enc, s._w * T + s._t, u);
      paint(s, sc.f(v));
      s.title = S.signal + " = " + fmt(v) + "  (" + quote(s._c) + ", position " + s._t + ")";
    }
    legend("leg", sc);
    const d = U(), g = hasKeep ? M.keep_gate : "h";
    $("unitinfo").innerHTML = "";
    const info = $("unitinfo");
    info.appendChild(el("strong", "", S.layer + " unit " + u));
    info.append(" · mean " + g + " " + fmt(d.mean[u]) + " (untrained " + fmt(d.init[u]) +
      ", shift " + signed(d.shift[u]) + ")" + (hasKeep ? " · half-life " +
      (d.half_life[u] === null ? "∞" : fmt(d.half_life[u], 2)) + " " + UNIT : "") +
      " · colour: " + S.signal + ", " + (S.model === "trained" ? "trained model" : "untrained model (step 0)"));
  }
  $("windows").addEventListener("mouseover", (ev) => {
    const s = ev.target;
    if (!s.classList || !s.classList.contains("ch")) return;
    const row = s._w * T + s._t, parts = [];
    for (const lab of ["trained", "untrained"]) {
      const enc = D.models[lab][S.layer][S.signal];
      if (enc) parts.push(lab + " " + fmt(val(enc, row, S.unit)));
    }
    $("hover").textContent = "window " + (s._w + 1) + ", position " + s._t + ", " + quote(s._c) +
      ": " + S.signal + " of unit " + S.unit + " = " + parts.join(" · ");
  });

  // ---- perturbation view ---------------------------------------------------------------
  const PATHS = [["measured", "measured", "#222"], ["forget_path", "forget path", "#2166ac"],
    ["return_path", "return path", "#d6604d"]].filter((p) => P.paths[p[0]]);
  function drawPerturb() {
    const w = S.pwin, p = P.pos, K = T - p;
    const u = M.layers.indexOf(S.layer) * H() + S.unit;  // column of the pooled state
    const txt = Array.from(P.texts[w]), box = $("ptext");
    const series = {};
    for (const [k] of PATHS) {
      series[k] = [];
      for (let j = 0; j < K; j++) {
        series[k].push(S.pmode === "unit" ? val(P.paths[k], w * K + j, u) : P.norms[k][w][j]);
      }
    }
    const meas = series.measured, ref = Math.abs(P.norms.measured[w][0]) || 1;
    let sc;
    if (S.pmode === "unit") {
      const m = Math.max(1e-12, ...meas.map(Math.abs));
      sc = { stops: DIV, lo: -m, hi: m, f: (v) => ramp(DIV, (v / m + 1) / 2) };
      legend("pleg", sc);
    } else {
      sc = { stops: SEQ, f: (v) => ramp(SEQ, (Math.log10(Math.max(v / ref, 1e-3)) + 3) / 3) };
      $("plegbar").style.background = gradient(SEQ);
      $("pleglo").textContent = "‖δ‖ ≤ 0.001 ‖δₚ‖"; $("pleghi").textContent = "‖δₚ‖";
    }
    box.textContent = "";
    txt.forEach((c, t) => {
      const s = el("span", "ch", shown(c));
      if (t < p) s.className = "ch before";
      else {
        const v = meas[t - p];
        paint(s, sc.f(v));
        s.title = (S.pmode === "unit" ? "δ" + M.state + " unit " + S.unit : "‖δ" + M.state + "‖") +
          " = " + fmt(v) + " at lag " + (t - p);
      }
      if (t === p) {
        s.className = "ch pert";
        s.title = "changed: " + quote(P.orig[w]) + " → " + quote(c) + "; " + s.title;
      }
      box.appendChild(s);
    });
    $("pinfo").textContent = "Position " + p + ": " + quote(P.orig[w]) + " became " +
      quote(txt[p]) + ". Colour: the measured difference in " + M.state + " " +
      (S.pmode === "unit" ? "of " + S.layer + " unit " + S.unit : "over all units (norm)") + " at each later " + UNIT1 + "." +
      (P.has_paths ? " Forget path: the difference carried by the keep gate alone; return path: what re-enters through the gates." : "");
    chart(series);
  }
  function chart(series) {
    const W = 720, Hh = 230, L = 56, R = 120, Tp = 12, B = 34, K = series.measured.length;
    const log = S.pmode === "norm";
    const tf = (v) => log ? Math.log10(Math.max(Math.abs(v), 1e-12)) : v;
    let vals = [];
    for (const k in series) vals = vals.concat(series[k].map(tf).filter(isFinite));
    let lo = Math.min(...vals), hi = Math.max(...vals);
    if (log) { hi = Math.ceil(hi); lo = Math.floor(Math.max(lo, hi - 6)); }  // whole decades
    if (!(hi > lo)) { lo -= 1; hi += 1; }
    const nt = log ? hi - lo : 4;
    const x = (j) => L + (W - L - R) * j / Math.max(1, K - 1);
    const y = (v) => Tp + (Hh - Tp - B) * (1 - (Math.min(hi, Math.max(lo, v)) - lo) / (hi - lo));
    const svg = document.createElementNS(SVGNS, "svg");
    svg.setAttribute("viewBox", "0 0 " + W + " " + Hh);
    svg.setAttribute("role", "img");
    const add = (tag, attrs, text) => {
      const e = document.createElementNS(SVGNS, tag);
      for (const a in attrs) e.setAttribute(a, attrs[a]);
      if (text !== undefined) e.textContent = text;
      svg.appendChild(e);
      return e;
    };
    add("rect", { x: L, y: Tp, width: W - L - R, height: Hh - Tp - B, class: "frame" });
    for (let i = 0; i <= nt; i++) {
      const v = lo + (hi - lo) * i / nt;
      add("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" });
      add("text", { x: L - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" },
        log ? (v === 0 ? "1" : "1e" + v) : tick(v, hi - lo));
    }
    for (let j = 0; j < K; j += Math.max(1, Math.ceil(K / 12))) {
      add("text", { x: x(j), y: Hh - B + 16, class: "tick", "text-anchor": "middle" }, String(j));
    }
    add("text", { x: L + (W - L - R) / 2, y: Hh - 4, class: "tick", "text-anchor": "middle" },
      UNIT + " after the change (lag)");
    add("text", { x: L + 6, y: Tp + 14, class: "tick" }, log ? "‖δ" + M.state + "‖ over all units"
      : "δ" + M.state + " of " + S.layer + " unit " + S.unit);
    if (!log) add("line", { x1: L, x2: W - R, y1: y(0), y2: y(0), class: "zero" });
    PATHS.forEach(([k, label, colour], i) => {
      const pts = series[k].map((v, j) => x(j).toFixed(1) + "," + y(tf(v)).toFixed(1)).join(" ");
      add("polyline", { points: pts, fill: "none", stroke: colour, "stroke-width": k === "measured" ? 2.2 : 1.6 });
      add("line", { x1: W - R + 10, x2: W - R + 30, y1: Tp + 10 + 18 * i, y2: Tp + 10 + 18 * i, stroke: colour, "stroke-width": 2 });
      add("text", { x: W - R + 34, y: Tp + 14 + 18 * i, class: "tick" }, label);
    });
    $("pchart").textContent = "";
    $("pchart").appendChild(svg);
  }

  // ---- wiring -----------------------------------------------------------------------------
  function pick(u) {
    if (u === undefined || u === null || Number.isNaN(u)) return;
    if (rows[S.unit]) rows[S.unit].classList.remove("sel");
    S.unit = u;
    rows[u].classList.add("sel");
    rows[u].scrollIntoView({ block: "nearest" });
    recolor();
    drawPerturb();
  }
  if (M.layers.length > 1) {
    $("layerbox").hidden = false;
    for (const l of M.layers) $("layer").appendChild(new Option(l, l));
    $("layer").addEventListener("change", () => { S.layer = $("layer").value; buildUnits(); pick(S.order[0]); });
  }
  buttons($("signals"), M.signals.map((s) => [s, s, "colour by " + s]), S.signal,
    (v) => { S.signal = v; recolor(); });
  buttons($("models"), [["trained", "trained", "the trained model"],
    ["untrained", "untrained", "the step-0 checkpoint, same windows"]], S.model,
  (v) => { S.model = v; recolor(); });
  buttons($("ranges"), [["fixed", "full range", "colour over the signal's whole range"],
    ["unit", "unit's range", "stretch the colours over this unit's own min to max"]], S.range,
  (v) => { S.range = v; recolor(); });
  buttons($("pmodes"), [["unit", "chosen unit"], ["norm", "norm over units"]], S.pmode,
    (v) => { S.pmode = v; drawPerturb(); });
  P.texts.forEach((_, w) => $("pwin").appendChild(new Option("window " + (w + 1), String(w))));
  $("pwin").addEventListener("change", () => { S.pwin = +$("pwin").value; drawPerturb(); });
  buildUnits();
  buildWindows();
  pick(S.order[0]);
  document.body.dataset.ready = "1";
})();
