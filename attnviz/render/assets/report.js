/* attnviz report front end: the head view, model view, heatmap and head statistics.
 *
 * One front end for every client. attnvizMount(root, data, options) draws report data (layout:
 * attnviz/render/html.py) into `root`, which holds the markup of report_body.html:
 *   - the standalone HTML report: this file is the page's inline script and mounts itself on
 *     the page's document and the JSON in #attnviz-data (options.page: the selection lives in
 *     the address, the arrow keys work on the whole page);
 *   - the notebook widget and the live server: a shadow root per view, so element ids, styles
 *     and state never meet another view on the same page (html.report_module() is this file
 *     as an ES module exporting `mount`).
 * Every element is looked up inside `root` and all state lives in the mount. Every piece of
 * text from the data (tokens, the input text, model names) is inserted with textContent or
 * drawn with fillText, never parsed as HTML. Nothing here makes a network request.
 *
 * options: page (bool), host (element whose width bounds the views), selection ({view, layer,
 * heads, words, special, scale, gamma, vmax}, model indices) to open with, onChange(selection)
 * called after every change of the selection. Returns {ready, selection(), set(selection), destroy()}.
 */
// Viridis, 256 entries of RGB as hex: the bytes matplotlib paints (colour_table("viridis").rgb).
const ATTNVIZ_VIRIDIS_HEX =
  "44015444025544035745055845065a45085b46095c460b5e460c5f460e61470f62471163471265471466471567471669" +
  "47186a48196b481a6c481c6e481d6f481e70482071482172482273482374472575472676472777472878472a79472b7a" +
  "472c7b462d7c462f7c46307d46317e45327f45347f453580453681443781443982433a83433b83433c84423d84423e85" +
  "4240854141864142864043874044873f45873f47883e48883e49893d4a893d4b893d4c893c4d8a3c4e8a3b508a3b518a" +
  "3a528b3a538b39548b39558b38568b38578c37588c37598c365a8c365b8c355c8c355d8c345e8d345f8d33608d33618d" +
  "32628d32638d31648d31658d31668d30678d30688d2f698d2f6a8d2e6b8e2e6c8e2e6d8e2d6e8e2d6f8e2c708e2c718e" +
  "2c728e2b738e2b748e2a758e2a768e2a778e29788e29798e287a8e287a8e287b8e277c8e277d8e277e8e267f8e26808e" +
  "26818e25828e25838d24848d24858d24868d23878d23888d23898d22898d228a8d228b8d218c8d218d8c218e8c208f8c" +
  "20908c20918c1f928c1f938b1f948b1f958b1f968b1e978a1e988a1e998a1e998a1e9a891e9b891e9c891e9d881e9e88" +
  "1e9f881ea0871fa1871fa2861fa38620a48520a58521a68521a78422a78423a88323a98224aa8225ab8126ac8127ad80" +
  "28ae7f29af7f2ab07e2bb17d2cb17d2eb27c2fb37b30b47a32b57a33b67935b77836b87738b97639b9763bba753dbb74" +
  "3ebc7340bd7242be7144be7045bf6f47c06e49c16d4bc26c4dc26b4fc36951c46853c56755c66657c66559c7645bc862" +
  "5ec96160c96062ca5f64cb5d67cc5c69cc5b6bcd596dce5870ce5672cf5574d05477d05279d1517cd24f7ed24e81d34c" +
  "83d34b86d44988d5478bd5468dd64490d64392d74195d73f97d83e9ad83c9dd93a9fd938a2da37a5da35a7db33aadb32" +
  "addc30afdc2eb2dd2cb5dd2bb7dd29bade27bdde26bfdf24c2df22c5df21c7e01fcae01ecde01dcfe11cd2e11bd4e11a" +
  "d7e219dae218dce218dfe318e1e318e4e318e7e419e9e419ece41aeee51bf1e51cf3e51ef6e61ff8e621fae622fde724";
const ATTNVIZ_VIRIDIS = new Uint8Array(768);
for (let i = 0; i < 768; i++) ATTNVIZ_VIRIDIS[i] = parseInt(ATTNVIZ_VIRIDIS_HEX.substr(i * 2, 2), 16);

/* Colour scales, exactly as the command line's figures map weights to colours
 * (attnviz/render/heatmap.py: ColourScale, ResolvedScale.unit, ColourTable.unit_bins): the same
 * kinds, defaults and arithmetic, so a view and a PNG of the same head show the same colours.
 * A scale is {kind, gamma, vmax} as chosen ("auto" or a number); resolved against the data shown
 * it becomes {kind, gamma, top, auto}. */
const ATTNVIZ_SCALE = Object.freeze({
  kinds: ["power", "linear", "log"],
  kind: "power", // the default: small weights stay visible
  gamma: 0.5, // power 0.5: a weight a quarter of the maximum gets half the colour range
  vmax: "auto", // the top colour is the largest weight shown
  gammaRange: [0.05, 5],
  vmaxLimit: 1e6,
  logDecades: 3, // the log scale shows weights from top / 1000 to top
  bins: 256, // entries of the colour map
});

// {kind, gamma, vmax} from loose values (an address, Python, a form): null when not valid.
function attnvizCheckScale(kind, gamma, vmax) {
  if (!ATTNVIZ_SCALE.kinds.includes(kind)) return null;
  const g = Number(gamma);
  if (!Number.isFinite(g) || g < ATTNVIZ_SCALE.gammaRange[0] || g > ATTNVIZ_SCALE.gammaRange[1]) return null;
  let top = "auto";
  if (vmax !== "auto" && vmax !== "" && vmax !== null && vmax !== undefined) {
    top = Number(vmax);
    if (!Number.isFinite(top) || top <= 0 || top > ATTNVIZ_SCALE.vmaxLimit) return null;
  }
  return { kind, gamma: g, vmax: top };
}

// The scale for this data: an "auto" top is the largest finite weight of `arrays` (1 if none > 0).
function attnvizResolveScale(scale, arrays) {
  let top = scale.vmax;
  if (top === "auto") {
    top = -Infinity;
    for (const values of arrays) {
      for (let i = 0; i < values.length; i++) if (values[i] > top) top = values[i];
    }
    if (!(top > 0) || !Number.isFinite(top)) top = 1;
  }
  return { kind: scale.kind, gamma: scale.gamma, top, auto: scale.vmax === "auto" };
}

// A weight -> 0..1 (ResolvedScale.unit).
function attnvizScaleUnit(resolved, value) {
  if (resolved.kind === "linear") return value / resolved.top;
  if (resolved.kind === "power") {
    return Math.pow(value > 0 ? value : 0, resolved.gamma) / Math.pow(resolved.top, resolved.gamma);
  }
  const floor = resolved.top / Math.pow(10, ATTNVIZ_SCALE.logDecades);
  const low = Math.log10(floor);
  const high = Math.log10(resolved.top);
  return (Math.log10(Math.min(Math.max(value, floor), resolved.top)) - low) / (high - low);
}

// 0..1 -> the colour map's entry, as matplotlib bins it (NaN -> 0).
function attnvizScaleBin(unit) {
  const n = ATTNVIZ_SCALE.bins;
  if (Number.isNaN(unit)) return 0;
  return Math.max(0, Math.min(n - 1, Math.floor(unit * n)));
}

// The colour bar's ticks: [{unit, value, label}], as ResolvedScale.tick_units/tick_labels.
function attnvizScaleTicks(resolved) {
  const decades = ATTNVIZ_SCALE.logDecades;
  const units = resolved.kind === "log" ? Array.from({ length: decades + 1 }, (_, i) => i / decades)
    : [0, 0.5, 1];
  const floor = resolved.top / Math.pow(10, decades);
  return units.map((unit, i) => {
    let value;
    if (resolved.kind === "linear") value = unit * resolved.top;
    else if (resolved.kind === "power") value = resolved.top * Math.pow(unit, 1 / resolved.gamma);
    else value = floor * Math.pow(10, unit * decades);
    let label = attnvizFormatWeight(value);
    if (resolved.kind === "log" && i === 0) label = "\u2264" + label;
    return { unit, value, label };
  });
}

// A weight as the figures label it (heatmap._format_value): 0, two decimals from 0.1, else two
// significant digits, exactly as Python formats them ("{:.2f}", "{:.2g}").
function attnvizFormatWeight(value) {
  if (value === 0) return "0";
  if (Math.abs(value) >= 0.1) return attnvizRound(value, null, 2).text;
  const first = attnvizRound(value, 2, null); // "{:.2g}": fixed from 1e-4, else 5e-05
  if (first.exponent < -4 || first.exponent >= 2) {
    const mantissa = first.digits[0] + (first.digits[1] !== "0" ? "." + first.digits[1] : "");
    const sign = first.exponent < 0 ? "-" : "+";
    return (value < 0 ? "-" : "") + mantissa + "e" + sign + String(Math.abs(first.exponent)).padStart(2, "0");
  }
  const text = attnvizRound(value, null, 1 - first.exponent).text;
  return text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text;
}

// `value` rounded as Python rounds when it formats: on the exact binary value, ties to even.
// Either `significant` digits or `decimals` after the point. Returns {text (fixed notation),
// digits (the rounded significant digits), exponent (of the first of them)}.
function attnvizRound(value, significant, decimals) {
  const [mantissa, power] = Math.abs(value).toExponential(99).split("e"); // exact to 100 digits
  let digits = mantissa.replace(".", "");
  let exponent = Number(power);
  const keep = significant !== null ? significant : exponent + 1 + decimals;
  let kept = keep > 0 ? digits.slice(0, keep) : "";
  const rest = keep >= 0 ? digits.slice(keep) : "0".repeat(-keep) + digits;
  const tie = rest[0] === "5" && /^5?0*$/.test(rest);
  const last = kept.length ? Number(kept[kept.length - 1]) : 0;
  if (rest[0] > "5" || (rest[0] === "5" && !tie) || (tie && last % 2 === 1)) {
    // add one in the last kept place, carrying
    const carried = (BigInt(kept || "0") + 1n).toString();
    if (carried.length > Math.max(kept.length, 1) || (!kept.length)) exponent += 1;
    kept = carried;
  }
  if (significant !== null) kept = kept.slice(0, significant);
  digits = kept.padEnd(Math.max(1, significant || 0), "0");
  let text = "";
  if (significant === null) {
    const whole = kept.padStart(decimals + 1, "0");
    text = whole.slice(0, whole.length - decimals) + (decimals ? "." + whole.slice(whole.length - decimals) : "");
    text = (value < 0 && /[1-9]/.test(text) ? "-" : "") + text;
  }
  return { text, digits, exponent };
}

// "sqrt scale, top = max shown" (the colour bar's label, ResolvedScale.label).
function attnvizScaleLabel(resolved) {
  let name = resolved.kind + " scale";
  if (resolved.kind === "power") {
    name = resolved.gamma === 0.5 ? "sqrt scale" : "power " + Number(resolved.gamma.toPrecision(6)) + " scale";
  }
  return name + ", " + (resolved.auto ? "top = max shown" : "top = " + attnvizFormatWeight(resolved.top) + " (fixed)");
}

function attnvizMount(root, DATA, options) {
  "use strict";

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a"];
  const LINE_MIN = 0.01; // fainter lines are invisible: skip them in the full head view
  const LINE_BUDGET = 4000; // the full head view draws at most this many of the strongest lines
  const HOVER_MIN = 0.002; // a hovered token's lines: skip only the invisible ones
  const HEAD_VIEW_WIDTH = 280; // px between the two token columns
  const MAX_CANVAS_PX = 30000; // stay under browsers' canvas size limits
  const THUMB_MAX = 128; // model-view thumbnails: at most this many pixels a side
  const CACHE_LIMIT = 48; // matrices kept in memory

  const opts = options || {};
  const page = !!opts.page;
  const byId = (id) => root.getElementById(id);
  const cleanups = [];
  const TOP_K = DATA.top_k || 5;
  const initial = DATA.initial || {};

  const state = {
    doc: 0,
    view: "head",
    layer: 0, // position in doc.layers
    heads: [], // positions in doc.heads, sorted
    words: !!initial.words,
    special: initial.special !== false,
    scale: { kind: ATTNVIZ_SCALE.kind, gamma: ATTNVIZ_SCALE.gamma, vmax: ATTNVIZ_SCALE.vmax },
  };
  let current = null; // the decoded document on screen
  const decodedDocs = new Map();
  const matrixCache = new Map();
  let hover = null; // head view: {side: "q" | "k", index}
  let heatLayout = null;
  let built = { head: "", model: "", stats: "" };

  // ------------------------------------------------------------------ small helpers
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  // A model's name for titles: a local folder's name, not its path (the record keeps the path).
  function modelName(meta) {
    return meta.model_label || String(meta.model || "").split(/[\\/]/).filter(Boolean).pop() || "";
  }

  function clamp(value, low, high) {
    return Math.max(low, Math.min(high, value));
  }

  // Listeners outside `root` (window, document) are removed again by destroy().
  function listen(target, type, handler, capture) {
    target.addEventListener(type, handler, !!capture);
    cleanups.push(() => target.removeEventListener(type, handler, !!capture));
  }

  // Room for the views: the window on a page of its own, the host element when embedded.
  function roomWidth() {
    const width = opts.host ? opts.host.clientWidth : 0;
    return width > 0 ? width : window.innerWidth;
  }

  function roomHeight() {
    return page ? window.innerHeight : Math.min(window.innerHeight, 720);
  }

  // A report fitted into its window (DATA.fit: a notebook's fallback frame, which cannot grow):
  // the pixels left below `element` for a view, above the footer. Otherwise null.
  function fitHeight(element) {
    if (!page || !DATA.fit) return null;
    const top = element.getBoundingClientRect().top + window.scrollY;
    const foot = root.querySelector(".foot");
    const mainPad = 24; // main's bottom padding (report.css)
    return Math.max(60, window.innerHeight - top - (foot ? foot.offsetHeight : 0) - mainPad - 4);
  }

  function headColour(modelHead) {
    const count = current ? current.meta.num_heads : PALETTE.length;
    if (count <= PALETTE.length) return PALETTE[modelHead % PALETTE.length];
    return "hsl(" + Math.round((modelHead * 360) / count) + ", 65%, 45%)";
  }

  function digits() {
    return current && current.bits === 16 ? 4 : 3;
  }

  function fmt(value) {
    return value.toFixed(digits());
  }

  // The colour of a weight on a resolved scale (attnvizResolveScale), as the figures paint it.
  function colourAt(value, resolved) {
    const index = attnvizScaleBin(attnvizScaleUnit(resolved, value)) * 3;
    return [ATTNVIZ_VIRIDIS[index], ATTNVIZ_VIRIDIS[index + 1], ATTNVIZ_VIRIDIS[index + 2]];
  }

  // Dark text on light colours, white on dark ones (luminance < 0.5), as the figures write values.
  function textColour(rgb) {
    return (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]) / 255 < 0.5 ? "#fff" : "#000";
  }

  function scaleKey() {
    return state.scale.kind + ":" + state.scale.gamma + ":" + state.scale.vmax;
  }

  function dpr(heightCss) {
    const ratio = window.devicePixelRatio || 1;
    return Math.max(0.25, Math.min(ratio, MAX_CANVAS_PX / Math.max(1, heightCss)));
  }

  function sizeCanvas(canvas, width, height) {
    const ratio = dpr(Math.max(width, height));
    canvas.width = Math.max(1, Math.round(width * ratio));
    canvas.height = Math.max(1, Math.round(height * ratio));
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return ctx;
  }

  function showError(error) {
    const box = byId("error");
    box.textContent = "The report could not be drawn: " + (error && error.message ? error.message : error);
    box.hidden = false;
    console.error(error);
  }

  // ------------------------------------------------------------------ decoding
  async function decodeDoc(index) {
    const meta = DATA.docs[index];
    const block = meta.weights;
    if (block.encoding !== "zlib-base64") throw new Error("unknown weight encoding " + block.encoding);
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot decompress the weights: it needs DecompressionStream " +
        "(Chrome 80, Firefox 113, Safari 16.4 or newer)");
    }
    const [L, H, T, T2] = block.shape;
    const binary = atob(block.data);
    const packed = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) packed[i] = binary.charCodeAt(i);
    const stream = new Blob([packed]).stream().pipeThrough(new DecompressionStream("deflate"));
    const bytes = new Uint8Array(await new Response(stream).arrayBuffer());
    const count = L * H * T * T2;
    let values;
    if (block.bits === 8) {
      values = bytes;
    } else {
      values = new Uint16Array(count);
      for (let i = 0; i < count; i++) values[i] = bytes[i] | (bytes[count + i] << 8);
    }
    if (values.length !== count || bytes.length !== count * (block.bits / 8)) {
      throw new Error("the weights are damaged: expected " + count + " values");
    }
    // A measure's values above 1 (norm) were divided by block.range before quantisation.
    return { index, meta, L, H, T, values, bits: block.bits, top: (Math.pow(2, block.bits) - 1) / (block.range || 1), units: new Map() };
  }

  function loadDoc(index) {
    if (!decodedDocs.has(index)) decodedDocs.set(index, decodeDoc(index));
    return decodedDocs.get(index);
  }

  // ------------------------------------------------------------------ tokens, words, specials
  // The units on screen: tokens or words, without special tokens when they are hidden.
  function units() {
    const key = (state.words ? "w" : "t") + (state.special ? "s" : "-");
    if (current.units.has(key)) return current.units.get(key);
    const meta = current.meta;
    const T = current.T;
    let groups = null;
    let labels = meta.display_tokens;
    let special = meta.special;
    if (state.words && meta.words) {
      groups = meta.words.groups;
      labels = meta.words.labels;
      special = meta.words.special;
    }
    const count = groups ? groups.length : T;
    const keyGroup = new Int32Array(T);
    if (groups) groups.forEach((members, g) => members.forEach((t) => { keyGroup[t] = g; }));
    let keep = [];
    for (let u = 0; u < count; u++) if (state.special || !special[u]) keep.push(u);
    const result = {
      groups, keyGroup, count, keep,
      n: keep.length,
      labels: keep.map((u) => labels[u]),
      special: keep.map((u) => !!special[u]),
      tokenIndex: keep.map((u) => (groups ? groups[u][0] : u)),
    };
    current.units.set(key, result);
    return result;
  }

  // [query, key] weights of one head as a Float32Array of n*n, in the current units.
  function viewMatrix(layer, head, useCache) {
    const key = state.doc + "|" + layer + "|" + head + "|" + state.words + "|" + state.special;
    if (useCache !== false && matrixCache.has(key)) return matrixCache.get(key);
    const doc = current;
    const T = doc.T;
    const u = units();
    const offset = (layer * doc.H + head) * T * T;
    const inv = 1 / doc.top;
    let m = new Float32Array(T * T);
    for (let i = 0; i < T * T; i++) m[i] = doc.values[offset + i] * inv;
    let n = T;
    if (u.groups) {
      // Attention to a word is the sum over its pieces, from a word the mean (Clark et al.).
      const G = u.count;
      const summed = new Float32Array(T * G);
      for (let i = 0; i < T; i++) {
        const row = i * T;
        const out = i * G;
        for (let j = 0; j < T; j++) summed[out + u.keyGroup[j]] += m[row + j];
      }
      const merged = new Float32Array(G * G);
      for (let g = 0; g < G; g++) {
        const members = u.groups[g];
        const target = g * G;
        for (const i of members) {
          const source = i * G;
          for (let c = 0; c < G; c++) merged[target + c] += summed[source + c];
        }
        const scale = 1 / members.length;
        for (let c = 0; c < G; c++) merged[target + c] *= scale;
      }
      m = merged;
      n = G;
    }
    if (u.keep.length !== n) {
      // Hidden special tokens: drop their rows and columns, renormalise rows to sum to 1.
      const keep = u.keep;
      const k = keep.length;
      const out = new Float32Array(k * k);
      for (let a = 0; a < k; a++) {
        const row = keep[a] * n;
        let sum = 0;
        for (let b = 0; b < k; b++) {
          const v = m[row + keep[b]];
          out[a * k + b] = v;
          sum += v;
        }
        if (sum > 0) for (let b = 0; b < k; b++) out[a * k + b] /= sum;
      }
      m = out;
    }
    if (useCache !== false) {
      if (matrixCache.size >= CACHE_LIMIT) matrixCache.delete(matrixCache.keys().next().value);
      matrixCache.set(key, m);
    }
    return m;
  }

  function selectedMatrix() {
    if (state.heads.length === 1) return viewMatrix(state.layer, state.heads[0]);
    const n = units().n;
    const mean = new Float32Array(n * n);
    for (const head of state.heads) {
      const m = viewMatrix(state.layer, head);
      for (let i = 0; i < m.length; i++) mean[i] += m[i];
    }
    const scale = 1 / Math.max(1, state.heads.length);
    for (let i = 0; i < mean.length; i++) mean[i] *= scale;
    return mean;
  }

  function topK(values, count, k) {
    const order = [];
    for (let i = 0; i < count; i++) order.push(i);
    order.sort((a, b) => values(b) - values(a) || a - b); // ties: the lower position first
    return order.slice(0, k).map((i) => [i, values(i)]);
  }

  function notes() {
    const list = [];
    if (state.words && current.meta.words) list.push("word level");
    if (!state.special && current.meta.special.some(Boolean)) list.push("special tokens hidden, rows renormalised");
    if (current.meta.causal) list.push("causal");
    return list;
  }

  // "model: layer 3, head 7 (notes)"; several heads are a mean in the heatmap, a set elsewhere.
  // "minilm: " or, for a measure other than attention weights, "minilm: norm ||αf(x)||, ".
  function titleStart(meta) {
    const label = measureLabel(meta);
    return modelName(meta) + ": " + (label ? label + ", " : "");
  }

  // A report's document names its measure (measure_label); a live capture keeps it in the
  // sidecar's meta (measure, measure_conventions.label). "" for attention weights.
  function measureLabel(meta) {
    if (meta.measure_label) return meta.measure_label;
    const inner = meta.meta || {};
    if (!inner.measure || inner.measure === "weights") return "";
    const conventions = inner.measure_conventions || {};
    return conventions.label || inner.measure;
  }

  function selectionTitle(asMean) {
    const meta = current.meta;
    const layer = "layer " + meta.layers[state.layer];
    const what = asMean === false ? "" : "mean of ";
    let heads;
    if (state.heads.length === 0) heads = "no head selected";
    else if (state.heads.length === 1) heads = "head " + meta.heads[state.heads[0]];
    else if (state.heads.length === current.H) heads = what + "all " + current.H + " heads";
    else heads = what + "heads " + state.heads.map((h) => meta.heads[h]).join(", ");
    const extra = notes();
    return titleStart(meta) + layer + ", " + heads + (extra.length ? " (" + extra.join("; ") + ")" : "");
  }

  // ------------------------------------------------------------------ tooltip
  const tooltip = byId("tooltip");

  // Place the tooltip beside `anchor` ({x, y}, viewport pixels) when it fits, else by the mouse.
  // On a page of its own it is fixed to the window. Embedded, it is placed in the view's own box
  // (position: absolute): a notebook's panels may have `contain: strict` or a transform, which
  // makes `fixed` relative to the panel instead of the window, so the tooltip would land off.
  function showTooltip(event, build, anchor) {
    tooltip.replaceChildren();
    build(tooltip);
    tooltip.style.left = "0px"; // measured where it has the most room
    tooltip.style.top = "0px";
    tooltip.hidden = false;
    const pad = 14;
    const box = tooltip.getBoundingClientRect();
    const frame = page ? null : tooltip.offsetParent;
    const rect = frame ? frame.getBoundingClientRect() : null;
    // Where it may go, in viewport pixels: the window, and the view's box when embedded.
    const left = rect ? Math.max(0, rect.left) : 0;
    const top = rect ? Math.max(0, rect.top) : 0;
    const right = rect ? Math.min(window.innerWidth, rect.right) : window.innerWidth;
    const bottom = rect ? Math.min(window.innerHeight, rect.bottom) : window.innerHeight;
    const besideAnchor = anchor && anchor.x + box.width < right - 4;
    let x = besideAnchor ? anchor.x : event.clientX + pad;
    let y = besideAnchor ? anchor.y : event.clientY + pad;
    if (x + box.width > right - 4) x = Math.max(left + 4, event.clientX - pad - box.width);
    if (y + box.height > bottom - 4) y = Math.max(top + 4, bottom - 4 - box.height);
    if (frame) {
      x -= rect.left + frame.clientLeft;
      y -= rect.top + frame.clientTop;
    }
    tooltip.style.left = Math.round(x) + "px";
    tooltip.style.top = Math.round(y) + "px";
  }

  function hideTooltip() {
    tooltip.hidden = true;
    tooltip.classList.remove("wide");
    tooltip.replaceChildren();
  }

  function tooltipSection(table, title, colour, entries, labels) {
    const head = el("tr");
    const th = el("th");
    th.colSpan = 3;
    if (colour) {
      const swatch = el("span", "swatch");
      swatch.style.setProperty("--chip", colour);
      th.appendChild(swatch);
    }
    th.appendChild(document.createTextNode(title));
    head.appendChild(th);
    table.appendChild(head);
    entries.forEach(([index, weight], rank) => {
      const row = el("tr", "entry");
      row.dataset.index = String(index);
      row.appendChild(el("td", "rank", String(rank + 1)));
      row.appendChild(el("td", "tok", labels[index]));
      row.appendChild(el("td", "w", fmt(weight)));
      table.appendChild(row);
    });
  }

  // ------------------------------------------------------------------ head view
  function rowHeight(n) {
    return clamp(Math.floor(MAX_CANVAS_PX / Math.max(1, n)), 4, 20);
  }

  function layoutHeadView() {
    const u = units();
    const rowH = rowHeight(u.n);
    const fontPx = clamp(rowH - 5, 3, 13);
    for (const [id, side] of [["hv-left", "q"], ["hv-right", "k"]]) {
      const column = byId(id);
      const items = [];
      u.labels.forEach((label, i) => {
        const token = el("div", "tok" + (u.special[i] ? " special" : ""), label);
        token.dataset.i = String(i);
        token.dataset.side = side;
        token.style.height = rowH + "px";
        token.style.lineHeight = rowH + "px";
        token.style.fontSize = fontPx + "px";
        token.title = label;
        items.push(token);
      });
      column.replaceChildren(...items);
    }
    built.head = layoutKey();
  }

  function drawHeadView() {
    const u = units();
    const n = u.n;
    const rowH = rowHeight(n);
    const canvas = byId("hv-canvas");
    const width = HEAD_VIEW_WIDTH;
    const height = Math.max(1, n * rowH);
    const ctx = sizeCanvas(canvas, width, height);
    ctx.clearRect(0, 0, width, height);
    ctx.lineWidth = n > 200 ? 1 : 1.5;
    const y = (i) => i * rowH + rowH / 2;
    const meta = current.meta;
    const threshold = hover ? HOVER_MIN : lineThreshold(state.heads.map((h) => viewMatrix(state.layer, h)));
    for (const head of state.heads) {
      const m = viewMatrix(state.layer, head);
      ctx.strokeStyle = headColour(meta.heads[head]);
      if (hover) {
        ctx.lineWidth = 2;
        for (let other = 0; other < n; other++) {
          const w = hover.side === "q" ? m[hover.index * n + other] : m[other * n + hover.index];
          if (w < threshold) continue;
          ctx.globalAlpha = Math.min(1, w);
          ctx.beginPath();
          if (hover.side === "q") { ctx.moveTo(0, y(hover.index)); ctx.lineTo(width, y(other)); }
          else { ctx.moveTo(0, y(other)); ctx.lineTo(width, y(hover.index)); }
          ctx.stroke();
        }
        continue;
      }
      // One stroke per line: a single path of thousands of crossing lines is far slower to
      // rasterise than the same lines stroked one by one.
      for (let i = 0; i < n; i++) {
        const yi = y(i);
        const row = i * n;
        for (let j = 0; j < n; j++) {
          const w = m[row + j];
          if (w < threshold) continue;
          ctx.globalAlpha = Math.min(1, w);
          ctx.beginPath();
          ctx.moveTo(0, yi);
          ctx.lineTo(width, y(j));
          ctx.stroke();
        }
      }
    }
    ctx.globalAlpha = 1;
    shadeTokens(n);
    for (const id of ["hv-left", "hv-right"]) {
      const side = id === "hv-left" ? "q" : "k";
      for (const token of byId(id).querySelectorAll(".tok.active")) token.classList.remove("active");
      if (hover && hover.side === side) {
        const token = byId(id).children[hover.index];
        if (token) token.classList.add("active");
      }
    }
  }

  // While a token is hovered, shade the tokens on the other side by the (mean) weight.
  let shaded = [];
  function shadeTokens(n) {
    for (const token of shaded) token.style.backgroundColor = "";
    shaded = [];
    if (!hover || state.heads.length === 0) return;
    const m = selectedMatrix();
    const column = byId(hover.side === "q" ? "hv-right" : "hv-left").children;
    for (let other = 0; other < n && other < column.length; other++) {
      const w = hover.side === "q" ? m[hover.index * n + other] : m[other * n + hover.index];
      if (w < 0.01) continue;
      column[other].style.backgroundColor = "rgba(47, 111, 223, " + Math.min(0.7, w).toFixed(3) + ")";
      shaded.push(column[other]);
    }
  }

  // Long inputs: raise the cut-off so only the LINE_BUDGET strongest lines are drawn (the long
  // faint ones cost most of the drawing time and cannot be seen under the others).
  function lineThreshold(matrices) {
    const bins = 256;
    const histogram = new Uint32Array(bins);
    for (const m of matrices) {
      for (let i = 0; i < m.length; i++) {
        if (m[i] >= LINE_MIN) histogram[Math.min(bins - 1, Math.floor(m[i] * bins))]++;
      }
    }
    let total = 0;
    for (let b = bins - 1; b >= 0; b--) {
      total += histogram[b];
      if (total > LINE_BUDGET) return Math.max(LINE_MIN, (b + 1) / bins);
    }
    return LINE_MIN;
  }

  function headViewTooltip(event, token) {
    const u = units();
    const meta = current.meta;
    const index = hover.index;
    // Beside the right-hand column, level with the token, so no token is covered.
    const anchor = { x: byId("hv-right").getBoundingClientRect().right + 16,
      y: Math.max(4, token.getBoundingClientRect().top - 8) };
    showTooltip(event, (box) => {
      const asQuery = hover.side === "q";
      const title = (asQuery ? "query " : "key ") + index + ": " + u.labels[index] +
        "  (layer " + meta.layers[state.layer] + ")";
      box.appendChild(el("div", "tt-title", title));
      box.appendChild(el("div", "tt-sub", asQuery ? "attends most to" : "attended most by"));
      box.dataset.side = hover.side;
      box.dataset.index = String(index);
      const n = u.n;
      const sections = [];
      if (state.heads.length > 1) sections.push(["mean of selected heads", null, selectedMatrix()]);
      for (const head of state.heads.slice(0, 16)) {
        sections.push(["head " + meta.heads[head], headColour(meta.heads[head]), viewMatrix(state.layer, head)]);
      }
      // Side by side in columns, so that every head fits in a view of a few tokens' height.
      const grid = el("div", "tt-sections");
      const columns = sections.length <= 2 ? 1 : sections.length <= 6 ? 2 : sections.length <= 12 ? 3 : 4;
      grid.style.setProperty("--columns", String(columns));
      box.classList.toggle("wide", columns > 1);
      for (const [name, colour, m] of sections) {
        const value = asQuery ? (j) => m[index * n + j] : (i) => m[i * n + index];
        const table = el("table");
        tooltipSection(table, name, colour, topK(value, n, TOP_K), u.labels);
        grid.appendChild(table);
      }
      if (state.heads.length === 0) box.appendChild(el("div", "", "Select a head to see weights."));
      box.appendChild(grid);
    }, anchor);
  }

  function onHeadViewOver(event) {
    const token = event.target.closest(".tok");
    if (!token) return;
    hover = { side: token.dataset.side, index: Number(token.dataset.i) };
    drawHeadView();
    headViewTooltip(event, token);
  }

  function onHeadViewLeave() {
    if (!hover) return;
    hover = null;
    hideTooltip();
    drawHeadView();
  }

  function composeHeadView() {
    const u = units();
    const rowH = rowHeight(u.n);
    const lines = byId("hv-canvas");
    const labelWidth = Math.max(byId("hv-left").offsetWidth, 40);
    const titleH = 28;
    const width = labelWidth * 2 + HEAD_VIEW_WIDTH;
    const height = titleH + u.n * rowH;
    const canvas = document.createElement("canvas");
    const ctx = sizeCanvas(canvas, width, height);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, height);
    ctx.fillStyle = "#1d1f23";
    ctx.font = "600 13px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.fillText(selectionTitle(false), 6, titleH / 2);
    ctx.font = clamp(rowH - 5, 3, 13) + "px system-ui, sans-serif";
    u.labels.forEach((label, i) => {
      ctx.fillStyle = u.special[i] ? "#5f6670" : "#1d1f23";
      const yy = titleH + i * rowH + rowH / 2;
      ctx.textAlign = "right";
      ctx.fillText(label, labelWidth - 6, yy, labelWidth - 8);
      ctx.textAlign = "left";
      ctx.fillText(label, labelWidth + HEAD_VIEW_WIDTH + 6, yy, labelWidth - 8);
    });
    ctx.drawImage(lines, labelWidth, titleH, HEAD_VIEW_WIDTH, u.n * rowH);
    return canvas;
  }

  // ------------------------------------------------------------------ model view
  // A head's matrix pooled to at most THUMB_MAX pixels a side: each pixel holds the largest
  // weight of its block of tokens, so thin patterns survive (and the pooled maximum is the
  // matrix's maximum, which an "auto" top needs).
  function pooled(layer, head) {
    const m = viewMatrix(layer, head, false);
    const n = units().n;
    const block = Math.max(1, Math.ceil(n / THUMB_MAX));
    const r = Math.max(1, Math.ceil(n / block));
    const out = new Float32Array(r * r);
    for (let a = 0; a < r; a++) {
      for (let b = 0; b < r; b++) {
        let best = 0;
        for (let i = a * block; i < Math.min(n, (a + 1) * block); i++) {
          const row = i * n;
          for (let j = b * block; j < Math.min(n, (b + 1) * block); j++) if (m[row + j] > best) best = m[row + j];
        }
        out[a * r + b] = best;
      }
    }
    return { r, values: out };
  }

  function thumbnail(canvas, cell, resolved) {
    const { r, values } = cell;
    canvas.width = r;
    canvas.height = r;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(r, r);
    for (let i = 0; i < r * r; i++) {
      const [red, green, blue] = colourAt(values[i], resolved);
      image.data[i * 4] = red;
      image.data[i * 4 + 1] = green;
      image.data[i * 4 + 2] = blue;
      image.data[i * 4 + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
  }

  function modelCellSize() {
    const available = Math.max(300, roomWidth() - 120);
    let size = Math.floor(available / current.H) - 8;
    const fit = fitHeight(byId("mv-grid"));
    if (fit !== null) size = Math.min(size, Math.floor((fit - 20) / current.L) - 8); // head labels, borders, gaps
    return clamp(size, 36, 110);
  }

  function statsFor(modelLayer, modelHead) {
    const rows = current.meta.stats;
    if (!rows) return null;
    return rows.find((row) => row.layer === modelLayer && row.head === modelHead) || null;
  }

  function buildModelView() {
    const grid = byId("mv-grid");
    const meta = current.meta;
    const size = modelCellSize();
    grid.style.gridTemplateColumns = "auto repeat(" + current.H + ", " + (size + 4) + "px)";
    const items = [el("div", "label", "")];
    meta.heads.forEach((h) => items.push(el("div", "label", "head " + h)));
    // One colour scale for the whole grid, as the command line's overview draws it.
    const cells = [];
    for (let l = 0; l < current.L; l++) for (let h = 0; h < current.H; h++) cells.push(pooled(l, h));
    const resolved = attnvizResolveScale(state.scale, cells.map((cell) => cell.values));
    grid.dataset.top = String(resolved.top);
    grid.title = attnvizScaleLabel(resolved);
    for (let l = 0; l < current.L; l++) {
      items.push(el("div", "label", "layer " + meta.layers[l]));
      for (let h = 0; h < current.H; h++) {
        const canvas = el("canvas", "cell");
        canvas.dataset.layer = String(l);
        canvas.dataset.head = String(h);
        canvas.style.width = size + "px";
        canvas.style.height = size + "px";
        const stats = statsFor(meta.layers[l], meta.heads[h]);
        canvas.title = "layer " + meta.layers[l] + ", head " + meta.heads[h] +
          (stats && stats.label ? ": " + stats.label : "");
        thumbnail(canvas, cells[l * current.H + h], resolved);
        items.push(canvas);
      }
    }
    grid.replaceChildren(...items);
    built.model = layoutKey() + "|" + scaleKey() + "|" + size;
  }

  function markModelSelection() {
    for (const canvas of byId("mv-grid").querySelectorAll("canvas")) {
      const on = Number(canvas.dataset.layer) === state.layer && state.heads.includes(Number(canvas.dataset.head));
      canvas.classList.toggle("selected", on);
    }
  }

  function composeModelView() {
    const meta = current.meta;
    const size = modelCellSize();
    const left = 64;
    const top = 48;
    const gap = 4;
    const width = left + current.H * (size + gap) + 8;
    const height = top + current.L * (size + gap) + 8;
    const canvas = document.createElement("canvas");
    const ctx = sizeCanvas(canvas, width, height);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, width, height);
    ctx.fillStyle = "#1d1f23";
    ctx.font = "600 13px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    const extra = notes();
    ctx.fillText(titleStart(meta) + "every layer and head" + (extra.length ? " (" + extra.join("; ") + ")" : ""), 6, 14);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#5f6670";
    ctx.textAlign = "center";
    meta.heads.forEach((h, i) => ctx.fillText("head " + h, left + i * (size + gap) + size / 2, top - 10));
    ctx.textAlign = "right";
    meta.layers.forEach((l, i) => ctx.fillText("layer " + l, left - 6, top + i * (size + gap) + size / 2));
    ctx.imageSmoothingEnabled = false;
    for (const cell of byId("mv-grid").querySelectorAll("canvas")) {
      const l = Number(cell.dataset.layer);
      const h = Number(cell.dataset.head);
      ctx.drawImage(cell, left + h * (size + gap), top + l * (size + gap), size, size);
    }
    return canvas;
  }

  // ------------------------------------------------------------------ heatmap
  function truncateLabel(ctx, label, maxWidth) {
    if (ctx.measureText(label).width <= maxWidth) return label;
    let text = label;
    while (text.length > 1 && ctx.measureText(text + "\u2026").width > maxWidth) text = text.slice(0, -1);
    return text + "\u2026";
  }

  function drawHeatmap() {
    const canvas = byId("hm-canvas");
    const u = units();
    const n = u.n;
    const title = selectionTitle();
    canvas.setAttribute("aria-label", title);
    if (state.heads.length === 0 || n === 0) {
      const ctx = sizeCanvas(canvas, 420, 40);
      ctx.fillStyle = "#5f6670";
      ctx.font = "13px system-ui, sans-serif";
      ctx.fillText(n === 0 ? "No tokens left to show." : "Select at least one head.", 4, 24);
      heatLayout = null;
      return;
    }
    const m = selectedMatrix();
    const resolved = attnvizResolveScale(state.scale, [m]);
    let room = clamp(Math.min(roomWidth() - 300, roomHeight() * 1.2), 240, 1100);
    const fit = fitHeight(canvas);
    if (fit !== null) {
      // The title, the key labels (at most 12 px text, 148 px) and the margin take the rest.
      const probe = canvas.getContext("2d");
      probe.font = "12px system-ui, sans-serif";
      let widest = 20;
      for (const label of u.labels) widest = Math.max(widest, probe.measureText(label).width);
      room = Math.max(n, Math.min(room, fit - 26 - (Math.min(140, Math.ceil(widest)) + 8) - 12));
    }
    // Whole pixels per cell while they fit; past that, fractional cells fill the room.
    const cell = room / n >= 4 ? clamp(Math.floor(room / n), 4, 36) : room / n;
    const step = cell >= 9 ? 1 : Math.ceil(9 / cell);
    const fontPx = clamp(cell - 2, 9, 12);
    const probe = canvas.getContext("2d");
    probe.font = fontPx + "px system-ui, sans-serif";
    let labelW = 20;
    for (let i = 0; i < n; i += step) labelW = Math.max(labelW, probe.measureText(u.labels[i]).width);
    labelW = Math.min(140, Math.ceil(labelW)) + 8;
    const titleH = 26;
    const x0 = labelW;
    const y0 = titleH + labelW;
    const size = n * cell;
    const barX = x0 + size + 18;
    const barH = Math.max(size, 120);
    const width = barX + 14 + 64;
    const height = y0 + Math.max(size, barH) + 12;
    const ctx = sizeCanvas(canvas, Math.max(width, 360), height);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, Math.max(width, 360), height);
    ctx.fillStyle = "#1d1f23";
    ctx.font = "600 13px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.fillText(title, 4, titleH / 2);
    // The matrix: one pixel per cell, scaled up without smoothing.
    const pixels = document.createElement("canvas");
    pixels.width = n;
    pixels.height = n;
    const pctx = pixels.getContext("2d");
    const image = pctx.createImageData(n, n);
    for (let i = 0; i < n * n; i++) {
      const [red, green, blue] = colourAt(m[i], resolved);
      image.data[i * 4] = red;
      image.data[i * 4 + 1] = green;
      image.data[i * 4 + 2] = blue;
      image.data[i * 4 + 3] = 255;
    }
    pctx.putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(pixels, x0, y0, size, size);
    // Token labels: queries on the left, keys on top.
    ctx.font = fontPx + "px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    for (let i = 0; i < n; i += step) {
      ctx.fillStyle = u.special[i] ? "#5f6670" : "#1d1f23";
      const label = truncateLabel(ctx, u.labels[i], labelW - 8);
      ctx.textAlign = "right";
      ctx.fillText(label, x0 - 4, y0 + i * cell + cell / 2);
      ctx.save();
      ctx.translate(x0 + i * cell + cell / 2, y0 - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(label, 0, 0);
      ctx.restore();
    }
    // Values in the cells when they are big enough to read.
    if (cell >= 26) {
      ctx.font = "9px system-ui, sans-serif";
      ctx.textAlign = "center";
      for (let i = 0; i < n; i++) {
        for (let j = 0; j < n; j++) {
          const v = m[i * n + j];
          ctx.fillStyle = textColour(colourAt(v, resolved));
          ctx.fillText(v.toFixed(2), x0 + j * cell + cell / 2, y0 + i * cell + cell / 2);
        }
      }
    }
    // Colour bar: the colour map from 0 to 1 of the scale, ticks where the figures put them.
    for (let p = 0; p < barH; p++) {
      const index = attnvizScaleBin(1 - p / (barH - 1)) * 3;
      ctx.fillStyle = "rgb(" + ATTNVIZ_VIRIDIS[index] + "," + ATTNVIZ_VIRIDIS[index + 1] + "," +
        ATTNVIZ_VIRIDIS[index + 2] + ")";
      ctx.fillRect(barX, y0 + p, 14, 1);
    }
    ctx.fillStyle = "#1d1f23";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "left";
    for (const tick of attnvizScaleTicks(resolved)) {
      const yy = y0 + (1 - tick.unit) * (barH - 1);
      ctx.fillRect(barX + 14, yy, 4, 1);
      ctx.fillText(tick.label, barX + 20, yy);
    }
    const scaleLabel = attnvizScaleLabel(resolved);
    ctx.save();
    ctx.translate(barX + 58, y0 + barH / 2);
    ctx.rotate(Math.PI / 2);
    ctx.textAlign = "center";
    ctx.fillStyle = "#5f6670";
    ctx.fillText(scaleLabel, 0, 0, Math.max(barH, 120));
    ctx.restore();
    canvas.dataset.scale = scaleLabel;
    canvas.dataset.top = String(resolved.top);
    heatLayout = { x0, y0, cell, n, m, labels: u.labels };
    canvas.dataset.x0 = String(x0);
    canvas.dataset.y0 = String(y0);
    canvas.dataset.cell = String(cell);
    canvas.dataset.n = String(n);
  }

  function onHeatmapMove(event) {
    if (!heatLayout) return;
    const { x0, y0, cell, n, m, labels } = heatLayout;
    const rect = event.currentTarget.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left - x0) / cell);
    const row = Math.floor((event.clientY - rect.top - y0) / cell);
    if (row < 0 || col < 0 || row >= n || col >= n) {
      hideTooltip();
      return;
    }
    showTooltip(event, (box) => {
      box.dataset.query = String(row);
      box.dataset.key = String(col);
      box.appendChild(el("div", "tt-title", "query " + row + ": " + labels[row]));
      const table = el("table");
      const tr = el("tr", "entry");
      tr.dataset.index = String(col);
      tr.appendChild(el("td", "", "key " + col + ":"));
      tr.appendChild(el("td", "tok", labels[col]));
      tr.appendChild(el("td", "w", fmt(m[row * n + col])));
      table.appendChild(tr);
      box.appendChild(table);
    });
  }

  // ------------------------------------------------------------------ statistics
  const STAT_ORDER = ["layer", "head", "label", "entropy", "distance", "max_weight", "self",
    "previous", "next", "first", "sep", "punct"];
  let statSort = { key: null, descending: false };

  function buildStats() {
    const table = byId("stats-table");
    const rows = current.meta.stats || [];
    const keys = STAT_ORDER.filter((k) => rows.length && k in rows[0]);
    if (rows.length) for (const k of Object.keys(rows[0])) if (!keys.includes(k)) keys.push(k);
    const sorted = rows.slice();
    if (statSort.key) {
      const k = statSort.key;
      sorted.sort((a, b) => {
        const x = a[k];
        const y = b[k];
        const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return statSort.descending ? -order : order;
      });
    }
    const thead = el("thead");
    const headRow = el("tr");
    for (const k of keys) {
      const arrow = statSort.key === k ? (statSort.descending ? " \u25bc" : " \u25b2") : "";
      const th = el("th", k === "label" ? "label" : "", k.replace("_", " ") + arrow);
      th.addEventListener("click", () => {
        statSort = { key: k, descending: statSort.key === k ? !statSort.descending : false };
        buildStats();
      });
      headRow.appendChild(th);
    }
    thead.appendChild(headRow);
    const tbody = el("tbody");
    for (const row of sorted) {
      const tr = el("tr");
      tr.dataset.layer = String(row.layer);
      tr.dataset.head = String(row.head);
      for (const k of keys) {
        const v = row[k];
        const text = typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v === null ? "" : String(v);
        tr.appendChild(el("td", k === "label" ? "label" : "", text));
      }
      tr.addEventListener("click", () => {
        const l = current.meta.layers.indexOf(row.layer);
        const h = current.meta.heads.indexOf(row.head);
        if (l >= 0 && h >= 0) select({ layer: l, heads: [h], view: "heatmap" });
      });
      tbody.appendChild(tr);
    }
    table.replaceChildren(thead, tbody);
    built.stats = String(state.doc);
    markStatsSelection();
  }

  function markStatsSelection() {
    const meta = current.meta;
    for (const tr of byId("stats-table").querySelectorAll("tbody tr")) {
      const on = Number(tr.dataset.layer) === meta.layers[state.layer] &&
        state.heads.some((h) => meta.heads[h] === Number(tr.dataset.head));
      tr.classList.toggle("selected", on);
    }
  }

  // ------------------------------------------------------------------ controls and state
  function layoutKey() {
    return state.doc + "|" + state.words + "|" + state.special;
  }

  function buildControls() {
    const meta = current.meta;
    const layerSelect = byId("layer");
    layerSelect.replaceChildren(...meta.layers.map((l, i) => {
      const option = el("option", "", "layer " + l);
      option.value = String(i);
      return option;
    }));
    const heads = byId("heads");
    heads.replaceChildren(...meta.heads.map((h, i) => {
      const chip = el("button", "chip", String(h));
      chip.type = "button";
      chip.dataset.head = String(i);
      chip.title = "head " + h + ": click to show or hide, shift-click to show only this head";
      chip.style.setProperty("--chip", headColour(h));
      return chip;
    }));
    const words = byId("words");
    words.disabled = !meta.words;
    words.parentElement.title = meta.words ? words.parentElement.title : "Every word is a single token in this text";
    byId("special").disabled = !meta.special.some(Boolean);
    byId("stats-tab").hidden = !meta.stats;
    const info = byId("doc-info");
    const parts = [el("span", "", modelName(meta) + " \u00b7 " + meta.tokens.length + " tokens \u00b7 " +
      meta.layers.length + " of " + meta.num_layers + " layers \u00b7 " + meta.heads.length + " of " +
      meta.num_heads + " heads" + (meta.causal ? " \u00b7 causal" : "") + " \u00b7 " +
      current.bits + "-bit " + (measureLabel(meta) || "weights") + " \u00b7 text: ")];
    const full = meta.pair !== null && meta.pair !== undefined ? meta.text + "  |  " + meta.pair : meta.text;
    const text = el("span", "text", full);
    if (full.length > 240) {
      // Long inputs fold to three lines; a click unfolds them.
      text.classList.add("long");
      text.title = "click to show or hide the whole text";
      text.addEventListener("click", () => text.classList.toggle("open"));
    }
    parts.push(text);
    info.replaceChildren(...parts);
    built = { head: "", model: "", stats: "" };
  }

  function syncControls() {
    byId("doc").value = String(state.doc);
    byId("layer").value = String(state.layer);
    for (const chip of byId("heads").children) {
      chip.setAttribute("aria-pressed", String(state.heads.includes(Number(chip.dataset.head))));
    }
    byId("words").checked = state.words && !!current.meta.words;
    byId("special").checked = state.special;
    byId("scale").value = state.scale.kind;
    byId("gamma").value = String(state.scale.gamma);
    byId("gamma-label").hidden = state.scale.kind !== "power";
    const vmaxSelect = byId("vmax");
    const vmaxValue = String(state.scale.vmax);
    if (!Array.from(vmaxSelect.options).some((option) => option.value === vmaxValue)) {
      const option = el("option", "", vmaxValue + " (fixed)"); // a top given by the owner
      option.value = vmaxValue;
      vmaxSelect.appendChild(option);
    }
    vmaxSelect.value = vmaxValue;
    for (const tab of root.querySelectorAll(".tabs button")) {
      tab.setAttribute("aria-selected", String(tab.dataset.view === state.view));
    }
    for (const view of ["head", "model", "heatmap", "stats"]) byId("view-" + view).hidden = view !== state.view;
    byId("save-png").disabled = state.view === "stats";
  }

  function writeHash() {
    if (!page) return; // an embedded view keeps its selection in its owner (e.g. Python)
    const meta = current.meta;
    const hash = "#doc=" + state.doc + "&view=" + state.view + "&layer=" + meta.layers[state.layer] +
      "&heads=" + state.heads.map((h) => meta.heads[h]).join(",") + "&words=" + (state.words ? 1 : 0) +
      "&special=" + (state.special ? 1 : 0) + "&scale=" + state.scale.kind +
      "&gamma=" + state.scale.gamma + "&vmax=" + state.scale.vmax;
    if (location.hash === hash) return;
    try {
      history.replaceState(null, "", hash);
    } catch (error) {
      location.hash = hash; // some browsers refuse replaceState on file: pages
    }
  }

  function parseHash() {
    const params = {};
    for (const part of location.hash.replace(/^#/, "").split("&")) {
      if (!part) continue;
      const at = part.indexOf("=");
      if (at < 0) continue;
      params[decodeURIComponent(part.slice(0, at))] = decodeURIComponent(part.slice(at + 1));
    }
    return params;
  }

  // The selection as the address writes it, from values that may be numbers, lists or booleans.
  function asParams(values) {
    const params = {};
    for (const [key, value] of Object.entries(values || {})) {
      if (value === null || value === undefined) continue;
      if (Array.isArray(value)) params[key] = value.join(",");
      else if (typeof value === "boolean") params[key] = value ? "1" : "0";
      else params[key] = String(value);
    }
    return params;
  }

  // The selection in model indices: what an owner reads and sets.
  function selection() {
    const meta = current.meta;
    return { doc: state.doc, view: state.view, layer: meta.layers[state.layer],
      heads: state.heads.map((h) => meta.heads[h]), words: state.words, special: state.special,
      scale: state.scale.kind, gamma: state.scale.gamma, vmax: state.scale.vmax };
  }

  let notified = "";
  function notify() {
    const now = selection();
    const key = JSON.stringify(now);
    if (key === notified) return;
    notified = key;
    if (opts.onChange) opts.onChange(now);
  }

  // The colour scale from an address or an owner: scale, gamma and vmax, each kept only when the
  // result is a valid scale. Older addresses said scale=1 (linear, top 1) or scale=max.
  function applyScale(params) {
    let kind = params.scale;
    let vmax = params.vmax;
    if (kind === "1" || kind === "max") {
      if (vmax === undefined) vmax = kind === "1" ? "1" : "auto";
      kind = "linear";
    }
    for (const [key, value] of [["kind", kind], ["gamma", params.gamma], ["vmax", vmax]]) {
      if (value === undefined) continue;
      const trial = Object.assign({}, state.scale, { [key]: value });
      const checked = attnvizCheckScale(trial.kind, trial.gamma, trial.vmax);
      if (checked) state.scale = checked;
    }
  }

  // Apply what the address says to the state (unknown values are ignored).
  function applyHash(params) {
    const meta = current.meta;
    if (["head", "model", "heatmap", "stats"].includes(params.view)) {
      state.view = params.view === "stats" && !meta.stats ? "head" : params.view;
    }
    if (params.layer !== undefined) {
      const l = meta.layers.indexOf(Number(params.layer));
      if (l >= 0) state.layer = l;
    }
    if (params.heads !== undefined) {
      const heads = params.heads === "" ? [] : params.heads.split(",")
        .map((h) => meta.heads.indexOf(Number(h))).filter((h) => h >= 0);
      state.heads = Array.from(new Set(heads)).sort((a, b) => a - b);
    }
    if (params.words !== undefined) state.words = params.words === "1";
    if (params.special !== undefined) state.special = params.special !== "0";
    applyScale(params);
  }

  function render() {
    syncControls();
    writeHash();
    hideTooltip();
    notify();
    if (state.view === "head") {
      if (built.head !== layoutKey()) layoutHeadView();
      drawHeadView();
    } else if (state.view === "model") {
      if (built.model !== layoutKey() + "|" + scaleKey() + "|" + modelCellSize()) buildModelView();
      markModelSelection();
    } else if (state.view === "heatmap") {
      drawHeatmap();
    } else if (state.view === "stats") {
      if (built.stats !== String(state.doc)) buildStats();
      markStatsSelection();
    }
  }

  function select(change) {
    const modeChanged = ("words" in change && change.words !== state.words) ||
      ("special" in change && change.special !== state.special);
    Object.assign(state, change);
    if (modeChanged) {
      hover = null;
      matrixCache.clear();
    }
    render();
  }

  async function showDoc(index, params) {
    state.doc = clamp(index, 0, DATA.docs.length - 1);
    current = await loadDoc(state.doc);
    matrixCache.clear();
    hover = null;
    state.layer = 0;
    state.heads = current.meta.heads.map((_, i) => i);
    buildControls();
    if (params) applyHash(params);
    if (state.layer >= current.L) state.layer = 0;
    render();
  }

  function moveLayer(delta) {
    select({ layer: clamp(state.layer + delta, 0, current.L - 1) });
  }

  function moveHead(delta) {
    const from = state.heads.length === 1 ? state.heads[0] : delta > 0 ? -1 : current.H;
    select({ heads: [clamp(from + delta, 0, current.H - 1)] });
  }

  function savePng() {
    let canvas = null;
    if (state.view === "head") canvas = composeHeadView();
    else if (state.view === "model") canvas = composeModelView();
    else if (state.view === "heatmap") canvas = byId("hm-canvas");
    if (!canvas) return;
    const meta = current.meta;
    const heads = state.heads.length === 1 ? "H" + meta.heads[state.heads[0]] :
      state.heads.length === current.H ? "all" : "H" + state.heads.map((h) => meta.heads[h]).join("-");
    const name = ("attnviz_" + modelName(meta) + "_" + state.view + (state.view === "model" ? "" :
      "_L" + meta.layers[state.layer] + "_" + heads)).replace(/[^A-Za-z0-9_.-]+/g, "_") + ".png";
    canvas.toBlob((blob) => {
      if (!blob) {
        showError(new Error("the view is too large to save as PNG"));
        return;
      }
      const url = URL.createObjectURL(blob);
      const link = el("a");
      link.href = url;
      link.download = name;
      document.body.appendChild(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 30000);
    }, "image/png");
  }

  function wire() {
    const docSelect = byId("doc");
    DATA.docs.forEach((doc, i) => {
      const text = doc.text.length > 70 ? doc.text.slice(0, 69) + "\u2026" : doc.text;
      const option = el("option", "", (i + 1) + ": " + text);
      option.value = String(i);
      docSelect.appendChild(option);
    });
    byId("doc-label").hidden = DATA.docs.length < 2;
    docSelect.addEventListener("change", () => showDoc(Number(docSelect.value)).catch(showError));
    byId("layer").addEventListener("change", (e) => select({ layer: Number(e.target.value) }));
    byId("heads").addEventListener("click", (e) => {
      const chip = e.target.closest(".chip");
      if (!chip) return;
      const head = Number(chip.dataset.head);
      let heads;
      if (e.shiftKey) heads = [head];
      else if (state.heads.includes(head)) heads = state.heads.filter((h) => h !== head);
      else heads = state.heads.concat([head]).sort((a, b) => a - b);
      select({ heads });
    });
    byId("heads-all").addEventListener("click", () => select({ heads: current.meta.heads.map((_, i) => i) }));
    byId("heads-none").addEventListener("click", () => select({ heads: [] }));
    byId("words").addEventListener("change", (e) => select({ words: e.target.checked }));
    byId("special").addEventListener("change", (e) => select({ special: e.target.checked }));
    const changeScale = (key, value) => {
      const trial = Object.assign({}, state.scale, { [key]: value });
      const checked = attnvizCheckScale(trial.kind, trial.gamma, trial.vmax);
      if (checked) select({ scale: checked });
      else syncControls(); // not a valid value: show the one in use again
    };
    byId("scale").addEventListener("change", (e) => changeScale("kind", e.target.value));
    byId("gamma").addEventListener("change", (e) => changeScale("gamma", e.target.value));
    byId("vmax").addEventListener("change", (e) => changeScale("vmax", e.target.value));
    for (const tab of root.querySelectorAll(".tabs button")) {
      tab.addEventListener("click", () => select({ view: tab.dataset.view }));
    }
    byId("save-png").addEventListener("click", savePng);
    const headView = root.querySelector(".headview");
    headView.addEventListener("mouseover", onHeadViewOver);
    headView.addEventListener("mouseleave", onHeadViewLeave);
    byId("mv-grid").addEventListener("click", (e) => {
      const cell = e.target.closest("canvas");
      if (!cell) return;
      select({ layer: Number(cell.dataset.layer), heads: [Number(cell.dataset.head)], view: "heatmap" });
    });
    const heat = byId("hm-canvas");
    heat.addEventListener("mousemove", onHeatmapMove);
    heat.addEventListener("mouseleave", hideTooltip);
    // The arrow keys: anywhere on a page of its own; inside the view (focused) when embedded.
    // Embedded, the keys are taken on the window in the capture phase, before the page's own
    // shortcuts (Notebook 7 and JupyterLab handle keys on the document in the capture phase: the
    // arrows would move the notebook's cell as well), and stopped there when they are ours.
    const onKey = (e) => {
      if (!current || e.altKey || e.ctrlKey || e.metaKey) return;
      const moves = { ArrowUp: () => moveLayer(-1), ArrowDown: () => moveLayer(1),
        ArrowLeft: () => moveHead(-1), ArrowRight: () => moveHead(1) };
      if (!moves[e.key]) return;
      const path = e.composedPath();
      if (!page) {
        if (!path.includes(root)) return; // a key for something else on the page
        e.stopPropagation();
      }
      const tag = path[0] && path[0].tagName;
      if (tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA") return; // their own keys
      e.preventDefault();
      moves[e.key]();
    };
    listen(page ? document : window, "keydown", onKey, !page);
    if (page) {
      listen(window, "hashchange", () => {
        const params = parseHash();
        const doc = Number(params.doc);
        if (Number.isInteger(doc) && doc !== state.doc && doc >= 0 && doc < DATA.docs.length) {
          showDoc(doc, params).catch(showError);
        } else if (current) {
          applyHash(params);
          matrixCache.clear();
          render();
        }
      });
    }
    let resizeTimer = null;
    listen(window, "resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { if (current) render(); }, 150);
    });
    cleanups.push(() => clearTimeout(resizeTimer));
  }

  async function main() {
    wire();
    if (!page) {
      byId("title").textContent = DATA.title || "";
      byId("generator").textContent = DATA.generator || "";
    }
    // Data's initial selection, then the owner's, then the address.
    const start = { view: initial.view, layer: initial.layer, heads: initial.heads,
      scale: initial.scale, gamma: initial.gamma, vmax: initial.vmax };
    const params = Object.assign(asParams(start), asParams(opts.selection), page ? parseHash() : {});
    const doc = Number(params.doc);
    await showDoc(Number.isInteger(doc) ? doc : 0, params);
    // Stamp the load time once the first view has been painted.
    await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
    if (page) {
      window.attnvizReport = { loadMs: performance.now(), state };
      document.documentElement.dataset.ready = "1";
    } else if (opts.host) {
      opts.host.dataset.ready = "1";
    }
  }

  // Change the selection from outside (model indices, as selection() gives them).
  function set(change) {
    if (!current) {
      ready.then(() => set(change), () => {});
      return;
    }
    const params = asParams(change);
    const doc = Number(params.doc);
    if (params.doc !== undefined && Number.isInteger(doc) && doc !== state.doc && doc >= 0 &&
        doc < DATA.docs.length) {
      showDoc(doc, params).catch(showError);
      return;
    }
    const before = JSON.stringify(selection());
    applyHash(params);
    if (JSON.stringify(selection()) === before) return;
    matrixCache.clear();
    hover = null;
    render();
  }

  const ready = main();
  ready.catch(showError);
  return {
    ready,
    selection: () => (current ? selection() : null),
    set,
    destroy() {
      for (const undo of cleanups.splice(0)) undo();
      hideTooltip();
    },
  };
}

// The standalone report: this file is the page's inline script, next to the page's data.
if (typeof document !== "undefined" && document.currentScript &&
    document.getElementById("attnviz-data")) {
  attnvizMount(document, JSON.parse(document.getElementById("attnviz-data").textContent),
    { page: true });
}
