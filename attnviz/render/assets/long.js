/* attnviz long-context view: one head's (or the heads' mean) attention over a whole long
 * context, zoomable from the block atlas down to exact token-level tiles.
 *
 * One front end for two sources, chosen by <body data-long-source>:
 *   - "server" (page /long of attnviz serve: the --long-from capture, or /long#id=ID any long
 *     capture the server keeps): the capture's description comes from POST /api/long/view,
 *     atlas levels from /api/long/atlas and exact tiles from /api/long/tile, both as
 *     little-endian float32 (format "float32"), statistics from /api/long/stats;
 *   - "offline" (attnviz html --long-from DIR): the JSON in #attnviz-long-data carries the
 *     description and the coarser atlas levels (zlib + base64 float32); there are no exact
 *     tiles, so the finest embedded level is as far as the view goes.
 * The map shows queries down and keys across. The atlas level drawn is the finest whose
 * blocks are at least a pixel; at the server, once the view spans at most the tile bound,
 * the exact weights of the visible tokens (and a margin) are fetched. Token text is drawn
 * with fillText or set with textContent, never parsed as HTML.
 *
 *   - the notebook widget (attnviz.notebook_long): the same requests go to the kernel as the
 *     widget's custom messages (html.long_module() exports attnvizLongMount for it).
 * attnvizLongMount(root, source, host) draws into `root` (a document or a shadow root holding
 * the markup of long_body.html) and returns {ready (a promise), view(), setView({x0, y0,
 * span}), find(text), select({layer, head}), setScale({range, kind, gamma, vmax}), scale(),
 * bounds() ({minSpan, maxSpan}: tokens across), plot() ({left, top, side, dpr}: where the map
 * lies on the canvas, CSS pixels), level()}; the page sets it as window.attnvizLong.
 * `host` gets data-long-ready="1" once the first level is asked for. #long-readout carries
 * the hovered cell's values in data attributes (data-kind "exact": data-q, data-k, data-value,
 * data-masked; "atlas": data-block, data-row, data-col, data-sum, data-max, data-q, data-k,
 * data-masked); #long-legend the colour scale's data-top, data-kind, data-gamma, data-basis
 * ("head": the head's maximum, "tile", "level", "visible" or "vmax") and data-range.
 *
 * Colours: the command line's scales (power with gamma, linear, log; vmax), with the scale
 * arithmetic of report.js (html.long_script() puts its colour part in front of this file).
 * The top is fixed by default (the head's maximum, so colours stay put while panning and
 * zooming) or the largest value visible. Keys a query never sees are masked at every zoom,
 * to the token even inside an atlas block. The map follows its column's width and the
 * screen's pixel ratio; zoom stops at what the data holds.
 */
function attnvizLongServerSource() {
  "use strict";
  async function apiError(response) {
    try {
      const body = await response.json();
      const e = body.error || {};
      return new Error((e.message || response.statusText) + (e.hint ? ": " + e.hint : ""));
    } catch (_) {
      return new Error("the server answered " + response.status);
    }
  }

  async function post(path, body) {
    const response = await fetch(path, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!response.ok) throw await apiError(response);
    return new Float32Array(await response.arrayBuffer());
  }

  async function postJSON(path, body) {
    const response = await fetch(path, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!response.ok) throw await apiError(response);
    return response.json();
  }

  return {
    exact: true,
    id: null,
    async info() {
      const wanted = new URLSearchParams(location.hash.slice(1)).get("id");
      const meta = await postJSON("/api/long/view", wanted ? { id: wanted } : {});
      this.id = meta.id;
      return meta;
    },
    async atlas(layer, head, block) {
      const values = await post("/api/long/atlas",
                                { id: this.id, layer, head, block, format: "float32" });
      const n = Math.round(Math.sqrt(values.length / 2));
      return { n, sums: values.subarray(0, n * n), maxes: values.subarray(n * n) };
    },
    tile(layer, head, q0, q1, k0, k1) {
      return post("/api/long/tile", { id: this.id, layer, head, q0, q1, k0, k1, format: "float32" });
    },
    async stats() {
      const found = await postJSON("/api/long/stats", { id: this.id });
      const order = found.sinks.map((v, i) => [v, i]).filter((p) => p[0] > 0)
        .sort((a, b) => b[0] - a[0] || a[1] - b[1]).slice(0, 20);
      return { stats: found.stats,
               sinks: { threshold: found.threshold,
                        top: order.map((p) => ({ position: p[1], fraction: p[0] })) } };
    },
  };
}

function attnvizLongOfflineSource(data) {
  "use strict";
  async function inflate(text) {
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot decompress the atlas: it needs DecompressionStream " +
                      "(Chrome 80+, Firefox 113+, Safari 16.4+)");
    }
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Float32Array(await new Response(stream).arrayBuffer());
  }

  // A report of a short capture carries every head's whole matrix ("exact"): tiles are cut
  // from it, so the view reaches exact cells with their values as at the server.
  const matrices = new Map();
  async function matrix(layer, head) {
    const key = layer + "/" + head;
    if (!matrices.has(key)) {
      const entry = data.exact[String(layer)] && data.exact[String(layer)][String(head)];
      if (!entry) throw new Error("the report holds no weights for layer " + layer + ", head " + head);
      matrices.set(key, inflate(entry));
    }
    return matrices.get(key);
  }

  function offline(data) {
    return {
      exact: Boolean(data.exact),
      local: true, // every level is here: asking costs nothing
      async info() { return data; },
      async atlas(layer, head, block) {
        const level = data.atlas.levels.find((l) => l.block === block);
        const key = head === "mean" ? "mean" : String(head);
        const entry = level && level.heads[String(layer)] && level.heads[String(layer)][key];
        if (!entry) throw new Error("the report holds no atlas for this head at block " + block);
        const values = await inflate(entry);
        const n = level.n;
        return { n, sums: values.subarray(0, n * n), maxes: values.subarray(n * n) };
      },
      async tile(layer, head, q0, q1, k0, k1) {
        if (!data.exact) return null;
        const T = data.num_tokens, all = await matrix(layer, head);
        const out = new Float32Array((q1 - q0) * (k1 - k0));
        for (let q = q0; q < q1; q++) out.set(all.subarray(q * T + k0, q * T + k1), (q - q0) * (k1 - k0));
        return out;
      },
      async stats() { return { stats: data.stats, sinks: data.sinks }; },
    };
  }
  return offline(data);
}

function attnvizLongMount(root, source, host) {
  "use strict";
  const MARGIN_LEFT = 110; // CSS pixels left of the map (query labels)
  const MARGIN_TOP = 86; // CSS pixels above it (key labels)
  const LABEL_PX = 11; // a token row must be this many CSS pixels high for its label
  const VALUE_PX = 30; // an exact cell must be this many CSS pixels wide for its value
  const MIN_SPAN = 4; // tokens across at the deepest zoom into exact weights
  const MIN_BLOCKS = 4; // blocks across at the deepest zoom into an atlas level (no exact data)
  const MIN_SIDE = 160; // the map's side, CSS pixels, at the least
  const MASKED = [232, 233, 236]; // keys a query does not see: light grey, outside viridis
  const MAX_TILES = 12;
  const TILE_SIDE = 512; // rows and columns of a fetched tile, at most

  const $ = (id) => root.getElementById(id);
  const canvas = $("long-canvas");
  const ctx = canvas.getContext("2d");
  const readout = $("long-readout");
  const levelNote = $("long-level");
  const plotBox = canvas.parentElement;

  const state = {
    meta: null, stats: null, layer: 0, head: 0, metric: "max", view: { x0: 0, y0: 0, span: 1 },
    drawn: null, mark: null, grids: new Map(), pending: new Map(), tiles: [],
    headMax: new Map(), pointer: null, side: 0, dpr: 1, resolved: null,
    scale: { range: "fixed", kind: ATTNVIZ_SCALE.kind, gamma: ATTNVIZ_SCALE.gamma, vmax: "auto" },
    lastFind: { text: "", at: -1 },
  };

  function fail(error) {
    const box = $("long-error");
    box.textContent = String(error && error.message ? error.message : error);
    box.hidden = false;
  }

  // ------------------------------------------------------------------ size
  // The map is square; its side follows the width of its column and the window's height, and
  // the canvas holds devicePixelRatio pixels per CSS pixel (sharp labels on dense screens).
  function layout() {
    const width = Math.floor(plotBox.clientWidth || 0);
    const room = typeof window !== "undefined" ? window.innerHeight - 170 : 600;
    const side = Math.max(MIN_SIDE, Math.min(width - MARGIN_LEFT - 6, Math.max(room, 320)));
    const ratio = (typeof window !== "undefined" && window.devicePixelRatio) || 1;
    if (side === state.side && ratio === state.dpr) return false;
    state.side = side;
    state.dpr = ratio;
    const cssW = MARGIN_LEFT + side + 4, cssH = MARGIN_TOP + side + 4;
    canvas.style.width = cssW + "px";
    canvas.style.height = cssH + "px";
    canvas.width = Math.round(cssW * ratio);
    canvas.height = Math.round(cssH * ratio);
    return true;
  }

  function plotSize() { return state.side; } // CSS pixels

  function deviceSide() { return Math.max(1, Math.round(state.side * state.dpr)); }

  // ------------------------------------------------------------------ view geometry
  function finestBlock() { return Math.min(...state.meta.atlas.blocks); }

  // Zoom stops at what the data holds: exact weights down to MIN_SPAN tokens; an atlas
  // without exact tiles (the offline report) down to MIN_BLOCKS of its finest blocks.
  function bounds() {
    const T = state.meta.num_tokens;
    const least = source.exact ? MIN_SPAN : MIN_BLOCKS * finestBlock();
    return { minSpan: Math.min(T, least), maxSpan: T };
  }

  function clampView(view) {
    const T = state.meta.num_tokens;
    const b = bounds();
    const span = Math.max(Math.min(view.span, b.maxSpan), b.minSpan);
    const x0 = Math.max(0, Math.min(view.x0, T - span));
    const y0 = Math.max(0, Math.min(view.y0, T - span));
    return { x0, y0, span };
  }

  function setView(view) {
    state.view = clampView(view);
    draw();
  }

  function zoomAt(factor, fx, fy) {
    // keep the token under (fx, fy) (fractions of the plot) where it is
    const v = state.view;
    const span = v.span * factor;
    const x = v.x0 + fx * v.span;
    const y = v.y0 + fy * v.span;
    setView({ x0: x - fx * span, y0: y - fy * span, span });
  }

  // ------------------------------------------------------------------ data
  function levelFor(view) {
    const perPixel = view.span / plotSize();
    const levels = state.meta.atlas.blocks;
    const fits = levels.filter((b) => b >= perPixel);
    return fits.length ? Math.min(...fits) : Math.max(...levels);
  }

  function headKey() { return state.head === "mean" ? "mean" : Number(state.head); }

  function gridKey(block, layer, head) {
    return ["atlas", layer === undefined ? state.layer : layer,
            head === undefined ? state.head : head, block].join("/");
  }

  function noteMax(layer, head, maxes) {
    let top = 0;
    for (let i = 0; i < maxes.length; i++) if (maxes[i] > top) top = maxes[i];
    if (top > 0) state.headMax.set(layer + "/" + head, top);
  }

  function atlasGrid(block) {
    const key = gridKey(block);
    if (state.grids.has(key)) return state.grids.get(key);
    if (!state.pending.has(key)) {
      const layer = state.layer, head = state.head;
      state.pending.set(key, source.atlas(layer, headKey(), block).then((a) => {
        const T = state.meta.num_tokens;
        state.grids.set(key, { kind: "atlas", layer, head, block, r0: 0, c0: 0, rows: a.n,
                               cols: a.n, sums: a.sums, maxes: a.maxes, T, q1: T, k1: T });
        noteMax(layer, head, a.maxes); // any level's largest maximum is the head's maximum
        state.pending.delete(key);
        draw();
      }).catch((e) => { state.pending.delete(key); fail(e); }));
    }
    return null;
  }

  function covers(grid, q0, q1, k0, k1) {
    return grid.r0 <= q0 && grid.q1 >= q1 && grid.c0 <= k0 && grid.k1 >= k1;
  }

  function exactGrid(view) {
    const T = state.meta.num_tokens;
    const q0 = Math.floor(view.y0), q1 = Math.min(T, Math.ceil(view.y0 + view.span));
    const k0 = Math.floor(view.x0), k1 = Math.min(T, Math.ceil(view.x0 + view.span));
    const found = state.tiles.find((t) => t.layer === state.layer && t.head === state.head &&
                                          covers(t, q0, q1, k0, k1));
    if (found) return found;
    // a margin around the view (within the server's bound), so small moves need no fetch
    const cells = state.meta.tile.max_values;
    const grow = (lo, hi) => {
      const room = Math.max(hi - lo, Math.min(TILE_SIDE, Math.floor(Math.sqrt(cells)), 2 * (hi - lo)));
      const extra = Math.floor((room - (hi - lo)) / 2);
      const a = Math.max(0, Math.min(lo - extra, T - room));
      return [a, Math.min(T, a + room)];
    };
    const [r0, r1] = grow(q0, q1);
    const [c0, c1] = grow(k0, k1);
    const key = ["tile", state.layer, state.head, r0, r1, c0, c1].join("/");
    if (!state.pending.has(key)) {
      const layer = state.layer, head = state.head;
      state.pending.set(key, source.tile(layer, headKey(), r0, r1, c0, c1).then((values) => {
        state.pending.delete(key);
        if (!values) return;
        state.tiles.unshift({ kind: "exact", layer, head, block: 1, r0, c0, q1: r1, k1: c1,
                              rows: r1 - r0, cols: c1 - c0, values });
        state.tiles.length = Math.min(state.tiles.length, MAX_TILES);
        draw();
      }).catch((e) => { state.pending.delete(key); fail(e); }));
    }
    return null;
  }

  function heldAtlas() {
    // the finest level of this head already here (never a request)
    let best = null;
    for (const block of state.meta.atlas.blocks) {
      const g = state.grids.get(gridKey(block));
      if (g && (!best || g.block < best.block)) best = g;
    }
    return best;
  }

  function gridFor(view) {
    const meta = state.meta;
    if (source.exact && view.span <= meta.tile.view_side) {
      // Token level: the exact tile of the view, asked directly. No atlas level is asked for
      // meanwhile (a fine level is a pass over the whole head); a level already here stands in.
      const exact = exactGrid(view);
      if (exact) return exact;
      return heldAtlas();
    }
    const grid = atlasGrid(levelFor(view));
    return grid || heldAtlas();
  }

  // The head's maximum for the fixed scale. The report holds it (any level); the server
  // answers the coarsest level without a pass once its statistics are in (one pass for all
  // heads, asked for at the start), so it is asked for then, or when an atlas is drawn anyway.
  function headMaximum() {
    const key = state.layer + "/" + state.head;
    if (state.headMax.has(key)) return state.headMax.get(key);
    const coarsest = Math.max(...state.meta.atlas.blocks);
    if (source.local || (state.stats && state.head !== "mean")) atlasGrid(coarsest);
    return null;
  }

  // ------------------------------------------------------------------ drawing
  function cellValue(grid, r, c) {
    const i = r * grid.cols + c;
    if (grid.kind === "exact") return grid.values[i];
    if (state.metric === "max") return grid.maxes[i];
    const rows = Math.min(grid.block, grid.T - r * grid.block);
    return grid.sums[i] / rows;
  }

  function windowOf(layer) {
    const windows = state.meta.windows || [];
    return windows[state.meta.layers.indexOf(layer)] || 0;
  }

  // Whether no query of [qa, qb] sees any key of [ka, kb] (token positions, inclusive): keys
  // after the query (causal) and, under a sliding window w, keys at least w before it (query i
  // sees keys i - w < j <= i).
  function unseen(qa, qb, ka, kb) {
    const w = windowOf(state.layer);
    return (state.meta.causal && ka > qb) || (w ? qa - kb >= w : false);
  }

  function masked(grid, r, c) {
    if (grid.kind === "exact") {
      const q = grid.r0 + r, k = grid.c0 + c;
      return unseen(q, q, k, k);
    }
    const B = grid.block, T = state.meta.num_tokens;
    return unseen(r * B, Math.min(T, (r + 1) * B) - 1, c * B, Math.min(T, (c + 1) * B) - 1);
  }

  // The resolved colour scale of this drawing (report.js's scale arithmetic):
  // vmax given: that; "fixed": the head's maximum (blocks by mass: the level's largest mass),
  // or, until it is known at the server, the tile's; "visible": the largest value shown.
  function resolveScale(grid, visibleTop) {
    const s = state.scale;
    let top = null, basis = "";
    if (s.vmax !== "auto") { top = s.vmax; basis = "vmax"; }
    else if (s.range === "visible") { top = visibleTop; basis = "visible"; }
    else if (grid && grid.kind === "atlas" && state.metric === "mass") {
      top = 0;
      for (let r = 0; r < grid.rows; r++) {
        for (let c = 0; c < grid.cols; c++) if (!masked(grid, r, c)) top = Math.max(top, cellValue(grid, r, c));
      }
      basis = "level";
    } else {
      top = headMaximum();
      basis = "head";
      if (top === null && grid && grid.kind === "exact") {
        top = 0;
        for (let i = 0; i < grid.values.length; i++) if (grid.values[i] > top) top = grid.values[i];
        basis = "tile";
      }
    }
    if (!(top > 0) || !Number.isFinite(top)) top = 1;
    return { kind: s.kind, gamma: s.gamma, top, auto: s.vmax === "auto", basis };
  }

  function draw() {
    if (!state.meta) return;
    layout();
    const view = state.view;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const grid = gridFor(view);
    state.drawn = grid;
    if (grid) paint(grid, view);
    else state.resolved = null;
    ctx.setTransform(state.dpr, 0, 0, state.dpr, 0, 0);
    mark(view);
    if (grid && grid.kind === "exact") values(grid, view, plotSize());
    labels(view, plotSize());
    describe(grid, view);
    legend();
    zoomButtons();
    refreshReadout();
  }

  function paint(grid, view) {
    const S = deviceSide();
    const tpp = view.span / S; // tokens a device pixel
    const T = state.meta.num_tokens;
    // each device pixel row p: the tokens it covers [lo, hi] and the grid row of its centre
    const rowOf = new Int32Array(S), colOf = new Int32Array(S);
    const qlo = new Int32Array(S), qhi = new Int32Array(S), klo = new Int32Array(S), khi = new Int32Array(S);
    for (let p = 0; p < S; p++) {
      const a = view.y0 + p * tpp, b = view.y0 + (p + 1) * tpp;
      qlo[p] = Math.floor(a); qhi[p] = Math.min(T - 1, Math.max(qlo[p], Math.ceil(b) - 1));
      rowOf[p] = Math.floor((Math.floor(view.y0 + (p + 0.5) * tpp) - grid.r0) / grid.block);
      const c = view.x0 + p * tpp, d = view.x0 + (p + 1) * tpp;
      klo[p] = Math.floor(c); khi[p] = Math.min(T - 1, Math.max(klo[p], Math.ceil(d) - 1));
      colOf[p] = Math.floor((Math.floor(view.x0 + (p + 0.5) * tpp) - grid.c0) / grid.block);
    }
    const inside = (r, c) => r >= 0 && r < grid.rows && c >= 0 && c < grid.cols;
    let visibleTop = 0;
    for (let p = 0; p < S; p++) {
      const r = rowOf[p];
      if (r < 0 || r >= grid.rows || (p && r === rowOf[p - 1])) continue;
      for (let q = 0; q < S; q++) {
        const c = colOf[q];
        if (c < 0 || c >= grid.cols || (q && c === colOf[q - 1])) continue;
        if (!masked(grid, r, c)) visibleTop = Math.max(visibleTop, cellValue(grid, r, c));
      }
    }
    const resolved = resolveScale(grid, visibleTop);
    state.resolved = resolved;
    const image = ctx.createImageData(S, S);
    const px = image.data, pal = ATTNVIZ_VIRIDIS;
    for (let p = 0; p < S; p++) {
      const r = rowOf[p];
      for (let q = 0; q < S; q++) {
        const c = colOf[q];
        const o = 4 * (p * S + q);
        px[o + 3] = 255;
        // masked: the whole block, or (finer than a block) the keys this pixel's queries miss
        if (!inside(r, c) || masked(grid, r, c) || unseen(qlo[p], qhi[p], klo[q], khi[q])) {
          px[o] = MASKED[0]; px[o + 1] = MASKED[1]; px[o + 2] = MASKED[2];
          continue;
        }
        const k = 3 * attnvizScaleBin(attnvizScaleUnit(resolved, cellValue(grid, r, c)));
        px[o] = pal[k]; px[o + 1] = pal[k + 1]; px[o + 2] = pal[k + 2];
      }
    }
    ctx.putImageData(image, Math.round(MARGIN_LEFT * state.dpr), Math.round(MARGIN_TOP * state.dpr));
  }

  function mark(view) {
    if (state.mark === null) return;
    const S = plotSize(), tpp = view.span / S, m = state.mark;
    ctx.strokeStyle = "#ff3b30";
    ctx.lineWidth = 1;
    const y = MARGIN_TOP + (m - view.y0) / tpp, x = MARGIN_LEFT + (m - view.x0) / tpp;
    const h = Math.max(1, 1 / tpp);
    if (y + h >= MARGIN_TOP && y <= MARGIN_TOP + S) ctx.strokeRect(MARGIN_LEFT, y, S, h);
    if (x + h >= MARGIN_LEFT && x <= MARGIN_LEFT + S) ctx.strokeRect(x, MARGIN_TOP, h, S);
  }

  // Each exact cell's weight written in it, once cells are wide enough to hold it (as the
  // command line's figures annotate a short text), in a colour that reads on the cell.
  function values(grid, view, S) {
    const px = S / view.span;
    if (px < VALUE_PX || !state.resolved) return;
    ctx.font = `${Math.min(12, Math.floor(px / 3.2))}px system-ui, sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    const T = state.meta.num_tokens;
    const q1 = Math.min(T, Math.ceil(view.y0 + view.span)), k1 = Math.min(T, Math.ceil(view.x0 + view.span));
    for (let q = Math.floor(view.y0); q < q1; q++) {
      for (let k = Math.floor(view.x0); k < k1; k++) {
        const r = q - grid.r0, c = k - grid.c0;
        if (r < 0 || c < 0 || r >= grid.rows || c >= grid.cols || masked(grid, r, c)) continue;
        const v = cellValue(grid, r, c);
        const bin = 3 * attnvizScaleBin(attnvizScaleUnit(state.resolved, v));
        const light = 0.299 * ATTNVIZ_VIRIDIS[bin] + 0.587 * ATTNVIZ_VIRIDIS[bin + 1] +
          0.114 * ATTNVIZ_VIRIDIS[bin + 2];
        ctx.fillStyle = light > 140 ? "#1d2127" : "#ffffff";
        ctx.fillText(attnvizFormatWeight(v), MARGIN_LEFT + (k + 0.5 - view.x0) * px,
                     MARGIN_TOP + (q + 0.5 - view.y0) * px);
      }
    }
  }

  function short(token) {
    const t = String(token).replace(/\s+/g, " ");
    return t.length > 14 ? t.slice(0, 13) + "\u2026" : t;
  }

  function labels(view, S) {
    const tokens = state.meta.display_tokens;
    const pxPerToken = S / view.span;
    ctx.fillStyle = "#1d2127";
    ctx.font = "10px system-ui, sans-serif";
    if (pxPerToken >= LABEL_PX) {
      const first = Math.floor(view.y0), last = Math.min(tokens.length, Math.ceil(view.y0 + view.span));
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (let i = first; i < last; i++) {
        ctx.fillText(short(tokens[i]), MARGIN_LEFT - 4, MARGIN_TOP + (i + 0.5 - view.y0) * pxPerToken);
      }
      const k0 = Math.floor(view.x0), k1 = Math.min(tokens.length, Math.ceil(view.x0 + view.span));
      ctx.textAlign = "left";
      for (let i = k0; i < k1; i++) {
        ctx.save();
        ctx.translate(MARGIN_LEFT + (i + 0.5 - view.x0) * pxPerToken, MARGIN_TOP - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.fillText(short(tokens[i]), 0, 0);
        ctx.restore();
      }
      return;
    }
    // positions instead of labels: five ticks on each axis
    ctx.textBaseline = "middle";
    for (let j = 0; j <= 4; j++) {
      const f = j / 4;
      ctx.textAlign = "right";
      ctx.fillText(String(Math.round(view.y0 + f * view.span)), MARGIN_LEFT - 4, MARGIN_TOP + f * S);
      ctx.save();
      ctx.translate(MARGIN_LEFT + f * S, MARGIN_TOP - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(String(Math.round(view.x0 + f * view.span)), 0, 0);
      ctx.restore();
    }
    ctx.textAlign = "left";
    ctx.fillText("keys \u2192", MARGIN_LEFT, 10);
    ctx.save();
    ctx.translate(10, MARGIN_TOP);
    ctx.rotate(Math.PI / 2);
    ctx.fillText("queries \u2192", 0, 0);
    ctx.restore();
  }

  function describe(grid, view) {
    const a = Math.floor(view.y0), b = Math.ceil(view.y0 + view.span) - 1;
    const c = Math.floor(view.x0), d = Math.ceil(view.x0 + view.span) - 1;
    const where = `queries ${a}\u2013${b}, keys ${c}\u2013${d}`;
    const deepest = state.view.span <= bounds().minSpan;
    if (!grid) {
      levelNote.textContent = `loading\u2026 (${where})`;
      levelNote.dataset.level = "loading";
    } else if (grid.kind === "exact") {
      levelNote.textContent = `exact weights, token level (${where})`;
      levelNote.dataset.level = "exact";
    } else {
      const what = state.metric === "max" ? "block max" : "block mass (sum / queries)";
      const held = !source.exact && deepest ? "; the finest level this report holds" : "";
      levelNote.textContent = `atlas: ${grid.block}-token blocks, coloured by ${what} (${where})${held}`;
      levelNote.dataset.level = "atlas";
    }
    levelNote.dataset.block = grid ? String(grid.block) : "";
  }

  function zoomButtons() {
    const b = bounds();
    $("long-zoom-in").disabled = state.view.span <= b.minSpan;
    $("long-zoom-out").disabled = state.view.span >= b.maxSpan;
  }

  // ------------------------------------------------------------------ legend
  const BASIS = { vmax: "fixed vmax", visible: "largest value visible", level: "largest block mass of this level",
                  head: "this head's maximum", tile: "this tile's maximum (the head's is not computed yet)" };

  function legend() {
    const box = $("long-legend");
    const bar = $("long-legend-bar");
    const resolved = state.resolved;
    box.hidden = !resolved;
    if (!resolved) return;
    const data = box.dataset;
    data.top = String(resolved.top);
    data.kind = resolved.kind;
    data.gamma = String(resolved.gamma);
    data.basis = resolved.basis;
    data.range = state.scale.range;
    const width = Math.max(60, Math.min(260, plotSize() - 80));
    const height = 12, ratio = state.dpr;
    bar.style.width = width + "px";
    bar.style.height = height + "px";
    bar.width = Math.round(width * ratio);
    bar.height = Math.round(height * ratio);
    const g = bar.getContext("2d");
    const image = g.createImageData(bar.width, bar.height);
    for (let x = 0; x < bar.width; x++) {
      const k = 3 * attnvizScaleBin((x + 0.5) / bar.width);
      for (let y = 0; y < bar.height; y++) {
        const o = 4 * (y * bar.width + x);
        image.data[o] = ATTNVIZ_VIRIDIS[k]; image.data[o + 1] = ATTNVIZ_VIRIDIS[k + 1];
        image.data[o + 2] = ATTNVIZ_VIRIDIS[k + 2]; image.data[o + 3] = 255;
      }
    }
    g.putImageData(image, 0, 0);
    const ticks = $("long-legend-ticks");
    ticks.textContent = "";
    ticks.style.width = width + "px";
    for (const tick of attnvizScaleTicks(resolved)) {
      const span = document.createElement("span");
      span.textContent = tick.label;
      span.style.left = (tick.unit * 100) + "%";
      span.dataset.value = String(tick.value);
      ticks.appendChild(span);
    }
    const what = state.drawn && state.drawn.kind === "atlas"
      ? (state.metric === "max" ? "block max" : "block mass") : "weight";
    $("long-legend-label").textContent = `${what}: ${attnvizScaleLabel(resolved).replace(/, top = .*$/, "")}, ` +
      `top ${attnvizFormatWeight(resolved.top)} = ${BASIS[resolved.basis]}`;
  }

  // ------------------------------------------------------------------ hover
  function cellAt(event) {
    const rect = canvas.getBoundingClientRect();
    const S = plotSize();
    const x = (event.clientX - rect.left) - MARGIN_LEFT;
    const y = (event.clientY - rect.top) - MARGIN_TOP;
    if (x < 0 || y < 0 || x >= S || y >= S) return null;
    const tpp = state.view.span / S;
    return { q: Math.floor(state.view.y0 + y * tpp), k: Math.floor(state.view.x0 + x * tpp),
             fx: x / S, fy: y / S };
  }

  function token(i) {
    return `${i} \u201c${short(state.meta.display_tokens[i])}\u201d`;
  }

  function clearReadout() {
    const data = readout.dataset;
    for (const key of Object.keys(data)) delete data[key];
    readout.textContent = "Hover the map for values.";
  }

  // After anything that changes what is drawn (a jump, a tile arriving, another head): the
  // readout follows the cell now under the pointer, or is cleared when the pointer is away.
  function refreshReadout() {
    if (state.pointer) hover(state.pointer);
    else clearReadout();
  }

  function hover(event) {
    const cell = cellAt(event);
    const grid = state.drawn;
    clearReadout();
    if (!cell || !grid) return;
    const r = Math.floor((cell.q - grid.r0) / grid.block), c = Math.floor((cell.k - grid.c0) / grid.block);
    if (r < 0 || c < 0 || r >= grid.rows || c >= grid.cols) return;
    const data = readout.dataset;
    const i = r * grid.cols + c;
    const hidden = unseen(cell.q, cell.q, cell.k, cell.k);
    const note = hidden ? " (masked: the query does not see this key)" : "";
    if (grid.kind === "exact") {
      const value = grid.values[i];
      data.kind = "exact"; data.q = String(cell.q); data.k = String(cell.k);
      data.value = String(value);
      data.masked = hidden ? "1" : "0";
      readout.textContent = `query ${token(cell.q)} \u2192 key ${token(cell.k)}: ` +
        `${value.toPrecision(7)}${note}`;
      return;
    }
    const T = state.meta.num_tokens, B = grid.block;
    const q0 = r * B, q1 = Math.min(T, q0 + B) - 1, k0 = c * B, k1 = Math.min(T, k0 + B) - 1;
    data.kind = "atlas"; data.block = String(B); data.row = String(r); data.col = String(c);
    data.sum = String(grid.sums[i]); data.max = String(grid.maxes[i]);
    data.q = String(cell.q); data.k = String(cell.k); data.masked = hidden ? "1" : "0";
    const at = B <= state.view.span / plotSize() ? "" :
      `query ${token(cell.q)} \u2192 key ${token(cell.k)}${hidden ? ": masked" : ""}; `;
    readout.textContent = `${at}queries ${q0}\u2013${q1} \u00d7 keys ${k0}\u2013${k1} ` +
      `(${B}-token block): sum ${grid.sums[i].toPrecision(6)}, max ${grid.maxes[i].toPrecision(6)}, ` +
      `mass ${(grid.sums[i] / (q1 - q0 + 1)).toPrecision(4)}`;
  }

  // ------------------------------------------------------------------ find
  function find(text) {
    const meta = state.meta;
    const wanted = String(text).trim();
    const note = $("long-found");
    if (!wanted) return null;
    let at = null;
    if (/^-?\d+$/.test(wanted)) {
      const n = Number(wanted);
      at = n < 0 ? meta.num_tokens + n : n;
      if (at < 0 || at >= meta.num_tokens) {
        note.textContent = `no token ${wanted}: positions are 0\u2013${meta.num_tokens - 1}`;
        return null;
      }
    } else {
      // match across token boundaries: the tokens' text without spaces, case folded
      if (!state.joined) {
        const starts = [];
        let joined = "";
        meta.display_tokens.forEach((t, i) => {
          const piece = String(t).replace(/\s+/g, "").toLowerCase();
          for (let j = 0; j < piece.length; j++) starts.push(i);
          joined += piece;
        });
        state.joined = { text: joined, starts };
      }
      const needle = wanted.replace(/\s+/g, "").toLowerCase();
      const from = state.lastFind.text === needle ? state.lastFind.at + 1 : 0;
      let hit = state.joined.text.indexOf(needle, from);
      if (hit < 0 && from > 0) hit = state.joined.text.indexOf(needle);
      if (hit < 0) { note.textContent = `\u201c${wanted}\u201d is not in the text`; return null; }
      state.lastFind = { text: needle, at: hit };
      at = state.joined.starts[hit];
    }
    note.textContent = `token ${token(at)}`;
    note.dataset.position = String(at);
    state.mark = at;
    const span = Math.min(meta.num_tokens, 48);
    setView({ x0: at - span / 2, y0: at - span / 2, span });
    return at;
  }

  // ------------------------------------------------------------------ panels
  // three decimals for the usual fractions and nats; fewer once the integer part is long
  // (distances in tokens), so the table fits its panel; the cell's title has the full value
  function compact(v) {
    const a = Math.abs(v);
    return v.toFixed(a >= 1000 ? 0 : a >= 100 ? 1 : a >= 10 ? 2 : 3);
  }

  function fillStats() {
    const meta = state.meta, table = $("long-stats");
    table.textContent = "";
    $("long-stats-layer").textContent = `layer ${state.layer}`;
    const stats = state.stats ? state.stats.stats : null;
    if (!stats) { $("long-stats-layer").textContent += " (computing\u2026)"; return; }
    const names = Object.keys(stats);
    const position = meta.layers.indexOf(state.layer);
    if (!names.length) return;
    const head = table.insertRow();
    for (const name of ["head", ...names]) {
      const th = document.createElement("th");
      th.textContent = name.replace(/_/g, " ");
      th.title = name;
      head.appendChild(th);
    }
    for (let h = 0; h < meta.num_heads; h++) {
      const row = table.insertRow();
      if (String(h) === String(state.head)) row.className = "current";
      row.insertCell().textContent = String(h);
      for (const name of names) {
        const v = stats[name][position][h];
        const cell = row.insertCell();
        cell.textContent = v === null ? "" : compact(Number(v));
        if (v !== null) cell.title = String(v);
      }
    }
  }

  function fillSinks() {
    const table = $("long-sinks");
    table.textContent = "";
    const sinks = state.stats ? state.stats.sinks : null;
    if (!sinks) return;
    $("long-sinks-note").textContent = `Tokens by the fraction of heads whose mean attention ` +
      `to them exceeds ${sinks.threshold} (Gu et al.); click one to jump to it.`;
    const head = table.insertRow();
    for (const name of ["token", "fraction"]) {
      const th = document.createElement("th");
      th.textContent = name;
      head.appendChild(th);
    }
    if (!sinks.top.length) {
      const cell = table.insertRow().insertCell();
      cell.colSpan = 2;
      cell.textContent = "none: no token passes the threshold";
    }
    for (const item of sinks.top) {
      const row = table.insertRow();
      const link = document.createElement("a");
      link.href = "#";
      link.textContent = token(item.position);
      link.addEventListener("click", (e) => { e.preventDefault(); find(String(item.position)); });
      row.insertCell().appendChild(link);
      row.insertCell().textContent = Number(item.fraction).toFixed(3);
    }
  }

  // ------------------------------------------------------------------ start
  function options(select, values) {
    select.textContent = "";
    for (const [value, label] of values) {
      const option = document.createElement("option");
      option.value = String(value);
      option.textContent = label;
      select.appendChild(option);
    }
  }

  function select(choice) {
    if (choice.layer !== undefined) state.layer = Number(choice.layer);
    if (choice.head !== undefined) state.head = choice.head === "mean" ? "mean" : Number(choice.head);
    $("long-layer").value = String(state.layer);
    $("long-head").value = String(state.head);
    fillStats();
    draw();
  }

  function syncScale() {
    const s = state.scale;
    $("long-range").value = s.range;
    $("long-scale").value = s.kind;
    $("long-gamma").value = String(s.gamma);
    $("long-gamma-label").hidden = s.kind !== "power";
    $("long-vmax").value = s.vmax === "auto" ? "" : String(s.vmax);
    $("long-range").disabled = s.vmax !== "auto";
  }

  // {range, kind, gamma, vmax}: each part kept only when valid (report.js's checks); returns
  // whether every given part was taken.
  function setScale(change) {
    let taken = true;
    const next = Object.assign({}, state.scale);
    if (change.range !== undefined) {
      if (change.range === "fixed" || change.range === "visible") next.range = change.range;
      else taken = false;
    }
    for (const key of ["kind", "gamma", "vmax"]) {
      if (change[key] === undefined) continue;
      const trial = Object.assign({}, next, { [key]: change[key] === "" ? "auto" : change[key] });
      const checked = attnvizCheckScale(trial.kind, trial.gamma, trial.vmax);
      if (checked) Object.assign(next, checked);
      else taken = false;
    }
    state.scale = next;
    const note = $("long-scale-note");
    note.textContent = taken ? "" : `not a valid colour scale: gamma is ${ATTNVIZ_SCALE.gammaRange[0]}` +
      `\u2013${ATTNVIZ_SCALE.gammaRange[1]}, vmax a number above 0 (up to ${ATTNVIZ_SCALE.vmaxLimit}) or empty for auto`;
    syncScale();
    draw();
    return taken;
  }

  function wire() {
    $("long-layer").addEventListener("change", (e) => select({ layer: e.target.value }));
    $("long-head").addEventListener("change", (e) => select({ head: e.target.value }));
    $("long-metric").addEventListener("change", (e) => { state.metric = e.target.value; draw(); });
    $("long-range").addEventListener("change", (e) => setScale({ range: e.target.value }));
    $("long-scale").addEventListener("change", (e) => setScale({ kind: e.target.value }));
    $("long-gamma").addEventListener("change", (e) => setScale({ gamma: e.target.value }));
    $("long-vmax").addEventListener("change", (e) => setScale({ vmax: e.target.value.trim() }));
    $("long-zoom-in").addEventListener("click", () => zoomAt(0.5, 0.5, 0.5));
    $("long-zoom-out").addEventListener("click", () => zoomAt(2, 0.5, 0.5));
    $("long-reset").addEventListener("click", () => setView({ x0: 0, y0: 0, span: Infinity }));
    $("long-find").addEventListener("submit", (e) => { e.preventDefault(); find($("long-query").value); });
    const point = (e) => { state.pointer = { clientX: e.clientX, clientY: e.clientY }; };
    canvas.addEventListener("wheel", (e) => {
      const cell = cellAt(e);
      if (!cell) return;
      e.preventDefault();
      point(e);
      zoomAt(Math.exp(Math.max(-2, Math.min(2, e.deltaY * 0.002))), cell.fx, cell.fy);
    }, { passive: false });
    let drag = null;
    canvas.addEventListener("pointerdown", (e) => {
      if (!cellAt(e)) return;
      drag = { x: e.clientX, y: e.clientY, view: state.view };
      canvas.classList.add("dragging");
      canvas.setPointerCapture(e.pointerId);
    });
    canvas.addEventListener("pointermove", (e) => {
      point(e);
      if (drag) {
        const tpp = drag.view.span / plotSize();
        setView({ x0: drag.view.x0 - (e.clientX - drag.x) * tpp,
                  y0: drag.view.y0 - (e.clientY - drag.y) * tpp, span: drag.view.span });
      } else hover(e);
    });
    canvas.addEventListener("pointerleave", () => { if (!drag) { state.pointer = null; clearReadout(); } });
    const stop = () => { drag = null; canvas.classList.remove("dragging"); };
    canvas.addEventListener("pointerup", stop);
    canvas.addEventListener("pointercancel", stop);
    canvas.addEventListener("keydown", (e) => {
      const v = state.view, step = v.span / 8;
      const moves = { ArrowLeft: [-step, 0], ArrowRight: [step, 0], ArrowUp: [0, -step], ArrowDown: [0, step] };
      if (moves[e.key]) {
        e.preventDefault();
        setView({ x0: v.x0 + moves[e.key][0], y0: v.y0 + moves[e.key][1], span: v.span });
      } else if (e.key === "+" || e.key === "=") zoomAt(0.5, 0.5, 0.5);
      else if (e.key === "-") zoomAt(2, 0.5, 0.5);
    });
    // the map follows its column's width (a resized window, a notebook's output area)
    let queued = false;
    const relayout = () => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => { queued = false; if (layout()) draw(); });
    };
    if (typeof ResizeObserver !== "undefined") new ResizeObserver(relayout).observe(plotBox);
    if (typeof window !== "undefined") window.addEventListener("resize", relayout);
  }

  async function start() {
    const meta = await source.info();
    state.meta = meta;
    $("long-info").textContent = `${meta.model_label || meta.model} \u00b7 ${meta.num_tokens.toLocaleString()} tokens \u00b7 ` +
      `${meta.num_layers} layers \u00d7 ${meta.num_heads} heads` + (meta.causal ? " \u00b7 causal" : "") +
      (meta.window ? ` \u00b7 window ${meta.window}` : "") +
      (source.exact ? "" : ` \u00b7 offline report: atlas down to ${finestBlock()}-token blocks`);
    options($("long-layer"), meta.layers.map((l) => [l, String(l)]));
    options($("long-head"), [...Array(meta.num_heads).keys()].map((h) => [h, String(h)])
      .concat(meta.atlas.mean ? [["mean", "mean of heads"]] : []));
    options($("long-scale"), ATTNVIZ_SCALE.kinds.map((k) => [k, k]));
    wire();
    syncScale();
    state.layer = meta.layers[0];
    layout();
    state.view = clampView({ x0: 0, y0: 0, span: meta.num_tokens });
    select({ layer: state.layer, head: 0 });
    host.dataset.longReady = "1";
    source.stats().then((found) => {
      state.stats = found;
      fillStats();
      fillSinks();
      draw(); // the server now answers coarse levels without a pass: the fixed scale's maximum
    }).catch(fail);
  }

  const ready = start().catch(fail);
  return {
    ready,
    view: () => Object.assign({}, state.view),
    setView,
    find,
    select,
    setScale,
    scale: () => Object.assign({}, state.scale, state.resolved ? { top: state.resolved.top,
                                                                     basis: state.resolved.basis } : {}),
    bounds: () => (state.meta ? bounds() : null),
    plot: () => ({ left: MARGIN_LEFT, top: MARGIN_TOP, side: state.side, dpr: state.dpr }),
    level: () => (state.drawn ? { kind: state.drawn.kind, block: state.drawn.block } : null),
  };
}

// The page (attnviz serve's /long, or an offline report) mounts itself; a module importer
// (the notebook widget) calls attnvizLongMount with its own source.
if (typeof document !== "undefined" && document.body && document.body.dataset.longSource) {
  const kind = document.body.dataset.longSource;
  const source = kind === "offline"
    ? attnvizLongOfflineSource(JSON.parse(document.getElementById("attnviz-long-data").textContent))
    : attnvizLongServerSource();
  window.attnvizLong = attnvizLongMount(document, source, document.documentElement);
}
