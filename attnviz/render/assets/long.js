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
 * span}), find(text), select({layer, head}), level()}; the page sets it as window.attnvizLong.
 * `host` gets data-long-ready="1" once the first level is asked for. #long-readout carries
 * the hovered cell's values in data attributes (data-kind "exact": data-q, data-k, data-value;
 * "atlas": data-block, data-row, data-col, data-sum, data-max).
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

  function offline(data) {
    return {
      exact: false,
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
      tile() { return Promise.resolve(null); },
      async stats() { return { stats: data.stats, sinks: data.sinks }; },
    };
  }
  return offline(data);
}

function attnvizLongMount(root, source, host) {
  "use strict";
  const MARGIN_LEFT = 110;
  const MARGIN_TOP = 86;
  const LABEL_PX = 11; // a token row must be this many pixels high for its label
  const MIN_SPAN = 4; // tokens across at the deepest zoom
  const GAMMA = 0.5; // the command line's default power colour scale
  const MASKED = [232, 233, 236];
  const MAX_TILES = 12;
  const TILE_SIDE = 512; // rows and columns of a fetched tile, at most

  const $ = (id) => root.getElementById(id);
  const canvas = $("long-canvas");
  const ctx = canvas.getContext("2d");
  const readout = $("long-readout");
  const levelNote = $("long-level");

  const state = {
    meta: null, stats: null, layer: 0, head: 0, metric: "max", view: { x0: 0, y0: 0, span: 1 },
    drawn: null, mark: null, grids: new Map(), pending: new Map(), tiles: [], palette: null,
    lastFind: { text: "", at: -1 },
  };

  function fail(error) {
    const box = $("long-error");
    box.textContent = String(error && error.message ? error.message : error);
    box.hidden = false;
  }

  // ------------------------------------------------------------------ view geometry
  function plotSize() {
    return Math.min(canvas.width - MARGIN_LEFT - 4, canvas.height - MARGIN_TOP - 4);
  }

  function clampView(view) {
    const T = state.meta.num_tokens;
    const span = Math.max(Math.min(view.span, T), Math.min(MIN_SPAN, T));
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

  function atlasGrid(block) {
    const key = ["atlas", state.layer, state.head, block].join("/");
    if (state.grids.has(key)) return state.grids.get(key);
    if (!state.pending.has(key)) {
      state.pending.set(key, source.atlas(state.layer, headKey(), block).then((a) => {
        const T = state.meta.num_tokens;
        state.grids.set(key, { kind: "atlas", layer: state.layer, head: state.head, block,
                               r0: 0, c0: 0, rows: a.n, cols: a.n, sums: a.sums,
                               maxes: a.maxes, T, q1: T, k1: T });
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
      const a = Math.max(0, lo - extra);
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

  function gridFor(view) {
    const meta = state.meta;
    if (source.exact && view.span <= meta.tile.view_side) {
      const exact = exactGrid(view);
      if (exact) return exact;
    }
    const wanted = levelFor(view);
    const grid = atlasGrid(wanted);
    if (grid) return grid;
    // while the wanted level loads: the finest level already here
    let best = null;
    for (const block of meta.atlas.blocks) {
      const key = ["atlas", state.layer, state.head, block].join("/");
      const g = state.grids.get(key);
      if (g && (!best || g.block < best.block)) best = g;
    }
    return best;
  }

  // ------------------------------------------------------------------ drawing
  function cellValue(grid, r, c) {
    const i = r * grid.cols + c;
    if (grid.kind === "exact") return grid.values[i];
    if (state.metric === "max") return grid.maxes[i];
    const rows = Math.min(grid.block, grid.T - r * grid.block);
    return grid.sums[i] / rows;
  }

  function masked(grid, r, c) {
    // keys a query never sees: later ones (causal) and, under a sliding window w, those at
    // least w before it (query i sees keys i - w < j <= i); a block only when all its cells are
    const windows = state.meta.windows || [];
    const w = windows[state.meta.layers.indexOf(state.layer)];
    if (grid.kind === "exact") {
      const q = grid.r0 + r, k = grid.c0 + c;
      return (state.meta.causal && k > q) || (w ? q - k >= w : false);
    }
    const B = grid.block;
    return (state.meta.causal && c > r) || (w ? r * B - ((c + 1) * B - 1) >= w : false);
  }

  function draw() {
    if (!state.meta) return;
    const view = state.view;
    const S = plotSize();
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const grid = gridFor(view);
    state.drawn = grid;
    if (grid) paint(grid, view, S);
    labels(view, S);
    describe(grid, view);
  }

  function paint(grid, view, S) {
    const tpp = view.span / S;
    const rowOf = new Int32Array(S), colOf = new Int32Array(S);
    for (let p = 0; p < S; p++) {
      rowOf[p] = Math.floor((Math.floor(view.y0 + (p + 0.5) * tpp) - grid.r0) / grid.block);
      colOf[p] = Math.floor((Math.floor(view.x0 + (p + 0.5) * tpp) - grid.c0) / grid.block);
    }
    let top = 0;
    for (let p = 0; p < S; p++) {
      const r = rowOf[p];
      if (r < 0 || r >= grid.rows || (p && r === rowOf[p - 1])) continue;
      for (let q = 0; q < S; q++) {
        const c = colOf[q];
        if (c < 0 || c >= grid.cols || (q && c === colOf[q - 1])) continue;
        if (!masked(grid, r, c)) top = Math.max(top, cellValue(grid, r, c));
      }
    }
    const image = ctx.createImageData(S, S);
    const px = image.data, pal = state.palette;
    for (let p = 0; p < S; p++) {
      const r = rowOf[p];
      for (let q = 0; q < S; q++) {
        const c = colOf[q];
        const o = 4 * (p * S + q);
        px[o + 3] = 255;
        if (r < 0 || r >= grid.rows || c < 0 || c >= grid.cols || masked(grid, r, c)) {
          px[o] = MASKED[0]; px[o + 1] = MASKED[1]; px[o + 2] = MASKED[2];
          continue;
        }
        const v = cellValue(grid, r, c);
        const t = top > 0 ? Math.pow(Math.max(0, Math.min(1, v / top)), GAMMA) : 0;
        const k = 3 * Math.min(255, Math.round(t * 255));
        px[o] = pal[k]; px[o + 1] = pal[k + 1]; px[o + 2] = pal[k + 2];
      }
    }
    ctx.putImageData(image, MARGIN_LEFT, MARGIN_TOP);
    state.top = top;
    if (state.mark !== null) {
      const m = state.mark;
      ctx.strokeStyle = "#ff3b30";
      ctx.lineWidth = 1;
      const y = MARGIN_TOP + (m - view.y0) / tpp, x = MARGIN_LEFT + (m - view.x0) / tpp;
      const h = Math.max(1, 1 / tpp);
      if (y + h >= MARGIN_TOP && y <= MARGIN_TOP + S) ctx.strokeRect(MARGIN_LEFT, y, S, h);
      if (x + h >= MARGIN_LEFT && x <= MARGIN_LEFT + S) ctx.strokeRect(x, MARGIN_TOP, h, S);
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
    if (!grid) {
      levelNote.textContent = `loading\u2026 (${where})`;
      levelNote.dataset.level = "loading";
    } else if (grid.kind === "exact") {
      levelNote.textContent = `exact weights, token level (${where})`;
      levelNote.dataset.level = "exact";
    } else {
      const what = state.metric === "max" ? "block max" : "block mass (sum / queries)";
      levelNote.textContent = `atlas: ${grid.block}-token blocks, coloured by ${what} (${where})`;
      levelNote.dataset.level = "atlas";
    }
    levelNote.dataset.block = grid ? String(grid.block) : "";
  }

  // ------------------------------------------------------------------ hover
  function cellAt(event) {
    const rect = canvas.getBoundingClientRect();
    const S = plotSize();
    const x = (event.clientX - rect.left) * (canvas.width / rect.width) - MARGIN_LEFT;
    const y = (event.clientY - rect.top) * (canvas.height / rect.height) - MARGIN_TOP;
    if (x < 0 || y < 0 || x >= S || y >= S) return null;
    const tpp = state.view.span / S;
    return { q: Math.floor(state.view.y0 + y * tpp), k: Math.floor(state.view.x0 + x * tpp),
             fx: x / S, fy: y / S };
  }

  function token(i) {
    return `${i} \u201c${short(state.meta.display_tokens[i])}\u201d`;
  }

  function hover(event) {
    const cell = cellAt(event);
    const grid = state.drawn;
    const data = readout.dataset;
    for (const key of Object.keys(data)) delete data[key];
    if (!cell || !grid) { readout.textContent = "Hover the map for values."; return; }
    const r = Math.floor((cell.q - grid.r0) / grid.block), c = Math.floor((cell.k - grid.c0) / grid.block);
    if (r < 0 || c < 0 || r >= grid.rows || c >= grid.cols) return;
    const i = r * grid.cols + c;
    if (grid.kind === "exact") {
      const value = grid.values[i];
      const hidden = masked(grid, r, c);
      data.kind = "exact"; data.q = String(cell.q); data.k = String(cell.k);
      data.value = String(value);
      data.masked = hidden ? "1" : "0";
      readout.textContent = `query ${token(cell.q)} \u2192 key ${token(cell.k)}: ` +
        `${value.toPrecision(7)}` + (hidden ? " (masked: the query does not see this key)" : "");
      return;
    }
    const T = state.meta.num_tokens, B = grid.block;
    const q0 = r * B, q1 = Math.min(T, q0 + B) - 1, k0 = c * B, k1 = Math.min(T, k0 + B) - 1;
    data.kind = "atlas"; data.block = String(B); data.row = String(r); data.col = String(c);
    data.sum = String(grid.sums[i]); data.max = String(grid.maxes[i]);
    readout.textContent = `queries ${q0}\u2013${q1} \u00d7 keys ${k0}\u2013${k1} ` +
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
      th.textContent = name;
      head.appendChild(th);
    }
    for (let h = 0; h < meta.num_heads; h++) {
      const row = table.insertRow();
      if (String(h) === String(state.head)) row.className = "current";
      row.insertCell().textContent = String(h);
      for (const name of names) {
        const v = stats[name][position][h];
        row.insertCell().textContent = v === null ? "" : Number(v).toFixed(3);
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

  function wire() {
    $("long-layer").addEventListener("change", (e) => select({ layer: e.target.value }));
    $("long-head").addEventListener("change", (e) => select({ head: e.target.value }));
    $("long-metric").addEventListener("change", (e) => { state.metric = e.target.value; draw(); });
    $("long-zoom-in").addEventListener("click", () => zoomAt(0.5, 0.5, 0.5));
    $("long-zoom-out").addEventListener("click", () => zoomAt(2, 0.5, 0.5));
    $("long-reset").addEventListener("click", () => setView({ x0: 0, y0: 0, span: Infinity }));
    $("long-find").addEventListener("submit", (e) => { e.preventDefault(); find($("long-query").value); });
    canvas.addEventListener("wheel", (e) => {
      const cell = cellAt(e);
      if (!cell) return;
      e.preventDefault();
      zoomAt(Math.exp(Math.max(-2, Math.min(2, e.deltaY * 0.002))), cell.fx, cell.fy);
      hover(e);
    }, { passive: false });
    let drag = null;
    canvas.addEventListener("pointerdown", (e) => {
      if (!cellAt(e)) return;
      drag = { x: e.clientX, y: e.clientY, view: state.view };
      canvas.classList.add("dragging");
      canvas.setPointerCapture(e.pointerId);
    });
    canvas.addEventListener("pointermove", (e) => {
      if (drag) {
        const rect = canvas.getBoundingClientRect();
        const tpp = drag.view.span / plotSize() * (canvas.width / rect.width);
        setView({ x0: drag.view.x0 - (e.clientX - drag.x) * tpp,
                  y0: drag.view.y0 - (e.clientY - drag.y) * tpp, span: drag.view.span });
      }
      hover(e);
    });
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
  }

  async function start() {
    const meta = await source.info();
    state.meta = meta;
    const hex = meta.palette;
    state.palette = new Uint8Array(768);
    for (let i = 0; i < 768; i++) state.palette[i] = parseInt(hex.substr(i * 2, 2), 16);
    $("long-info").textContent = `${meta.model_label || meta.model} \u00b7 ${meta.num_tokens.toLocaleString()} tokens \u00b7 ` +
      `${meta.num_layers} layers \u00d7 ${meta.num_heads} heads` + (meta.causal ? " \u00b7 causal" : "") +
      (meta.window ? ` \u00b7 window ${meta.window}` : "") +
      (source.exact ? "" : ` \u00b7 offline report: atlas down to ${Math.min(...meta.atlas.blocks)}-token blocks`);
    options($("long-layer"), meta.layers.map((l) => [l, String(l)]));
    options($("long-head"), [...Array(meta.num_heads).keys()].map((h) => [h, String(h)])
      .concat(meta.atlas.mean ? [["mean", "mean of heads"]] : []));
    wire();
    state.layer = meta.layers[0];
    state.view = clampView({ x0: 0, y0: 0, span: meta.num_tokens });
    select({ layer: state.layer, head: 0 });
    host.dataset.longReady = "1";
    source.stats().then((found) => {
      state.stats = found;
      fillStats();
      fillSinks();
    }).catch(fail);
  }

  const ready = start().catch(fail);
  return {
    ready,
    view: () => Object.assign({}, state.view),
    setView,
    find,
    select,
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
