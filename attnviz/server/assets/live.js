/* attnviz live page: a text box in front of a warm model, drawn with the report's front end.
 *
 * As you type (debounced), the text goes to this server's /api/capture and the answer -- one
 * document of the HTML report's data -- is drawn by report.js (attnvizMount) in a fresh shadow
 * root, swapped in once it has painted. The side panels ask /api/topk (top-k keys, a clicked
 * token's row) and /api/explain (the toy model's step-by-step calculation). The address keeps
 * the text and the selection after '#', so a link reproduces the view and the text never goes
 * to the server in a URL.
 *
 * Every text from the server (tokens, model names, messages) is inserted with textContent,
 * never parsed as HTML, and the only requests go to this server's /api (the page's
 * Content-Security-Policy allows nothing else).
 */
(function () {
  "use strict";

  const DEFAULT_TEXT = "The cat sat on the mat because it was warm.";
  const DEBOUNCE_MS = 200;
  const PANEL_DEBOUNCE_MS = 60;
  const ROW_K = 10;
  const SELECTION_KEYS = ["view", "layer", "heads", "words", "special", "scale", "gamma", "vmax"];
  const MEASURES = ["weights", "norm", "norm-res-ln", "alti", "value-zeroing"]; // attnviz.measures
  const byId = (id) => document.getElementById(id);

  const live = {
    text: DEFAULT_TEXT,
    pair: "",
    model: "",
    models: [],
    allowAny: false,
    toy: { scale: true, causal: false },
    measure: "weights", // or a measure of attnviz.measures (Hugging Face models only)
    k: 3,
    selection: {}, // as report.js reports it: view, layer, heads (model indices), words, ...
    query: null, // the clicked token (position in the units on screen)
    doc: null, // the capture on screen (the /api/capture answer)
    mount: null,
    host: null,
    seq: 0,
    updates: 0,
    lastHash: "",
    gone: false,
  };
  window.attnvizLive = live; // for tests and the curious: read-only use

  // ------------------------------------------------------------------ helpers
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "\u2212\u221e";
    return Number(value).toFixed(digits === undefined ? 4 : digits);
  }

  function isToy() {
    return live.model === "toy";
  }

  class ServerGone extends Error {}

  class ApiFailure extends Error {
    constructor(status, info) {
      super(info && info.message ? info.message : "the server answered HTTP " + status);
      this.status = status;
      this.hint = info && info.hint ? info.hint : "";
    }
  }

  async function request(method, path, body, signal) {
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: body === undefined ? {} : { "Content-Type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
        credentials: "same-origin",
        cache: "no-store",
        signal,
      });
    } catch (error) {
      if (error && error.name === "AbortError") throw error;
      throw new ServerGone("no answer");
    }
    if (!response.ok) {
      let info = null;
      try {
        info = (await response.json()).error;
      } catch (error) {
        info = null;
      }
      throw new ApiFailure(response.status, info);
    }
    if (live.gone) {
      live.gone = false;
      hideError();
    }
    return response;
  }

  async function api(path, body, signal) {
    return (await request("POST", path, body, signal)).json();
  }

  // ------------------------------------------------------------------ messages
  function showStatus(text, busy) {
    const status = byId("status");
    status.textContent = text;
    status.classList.toggle("busy", !!busy);
  }

  function hideError() {
    byId("live-error").hidden = true;
  }

  function showFailure(error) {
    const box = byId("live-error");
    if (error instanceof ServerGone) {
      live.gone = true;
      box.textContent = "The attnviz server at " + location.host + " is not answering: it may " +
        "have been stopped. Start it again with 'attnviz serve' and reload this page; the " +
        "address keeps your text and selection.";
      showStatus("server not answering");
    } else if (error instanceof ApiFailure) {
      let text = "Error: " + error.message;
      if (error.hint) text += " \u2014 " + error.hint;
      box.textContent = text;
      showStatus("error");
    } else {
      box.textContent = "Error: " + (error && error.message ? error.message : String(error));
      console.error(error);
    }
    box.hidden = false;
  }

  // ------------------------------------------------------------------ the address
  function readAddress() {
    const params = new URLSearchParams(location.hash.replace(/^#/, ""));
    live.text = params.has("text") ? params.get("text") : DEFAULT_TEXT;
    live.pair = params.get("pair") || "";
    live.model = params.get("model") || "";
    live.toy.scale = params.get("toy_scale") !== "0";
    live.toy.causal = params.get("toy_causal") === "1";
    live.measure = MEASURES.includes(params.get("measure")) ? params.get("measure") : "weights";
    const k = Number(params.get("k"));
    live.k = Number.isInteger(k) && k >= 1 && k <= 20 ? k : 3;
    const selection = {};
    for (const key of SELECTION_KEYS) if (params.has(key)) selection[key] = params.get(key);
    live.selection = selection;
    const query = params.get("query");
    live.query = query !== null && /^\d+$/.test(query) ? Number(query) : null;
    live.lastHash = location.hash;
  }

  function asText(value) {
    if (Array.isArray(value)) return value.join(",");
    if (typeof value === "boolean") return value ? "1" : "0";
    return String(value);
  }

  function writeAddress() {
    const params = new URLSearchParams();
    if (live.model) params.set("model", live.model);
    params.set("text", live.text);
    if (live.pair) params.set("pair", live.pair);
    if (isToy() && !live.toy.scale) params.set("toy_scale", "0");
    if (isToy() && live.toy.causal) params.set("toy_causal", "1");
    if (!isToy() && live.measure !== "weights") params.set("measure", live.measure);
    if (live.k !== 3) params.set("k", String(live.k));
    for (const key of SELECTION_KEYS) {
      const value = live.selection[key];
      if (value !== undefined && value !== null) params.set(key, asText(value));
    }
    if (live.query !== null) params.set("query", String(live.query));
    const hash = "#" + params.toString();
    if (hash === location.hash) return;
    history.replaceState(null, "", hash);
    live.lastHash = location.hash;
  }

  // ------------------------------------------------------------------ requests
  function modelFields() {
    const fields = { model: live.model || undefined };
    if (isToy()) fields.toy = { scale: live.toy.scale, causal: live.toy.causal };
    return fields;
  }

  function captureFields() {
    const fields = Object.assign({ text: live.text }, modelFields());
    if (live.pair.trim()) fields.pair = live.pair;
    if (!isToy() && live.measure !== "weights") fields.measure = live.measure;
    return fields;
  }

  // The heads the panels use: one head, the layer's mean (all selected) or the selected mean.
  function headChoice() {
    const heads = (live.selection.heads || []).map(Number);
    if (!heads.length || !live.doc) return null;
    if (heads.length === 1) return heads[0];
    if (heads.length === live.doc.heads.length) return "mean";
    return heads;
  }

  function viewFields(extra) {
    const selection = live.selection;
    return Object.assign(captureFields(), {
      layer: Number(selection.layer),
      head: headChoice(),
      words: selection.words === true || selection.words === "1",
      exclude_special: selection.special === false || selection.special === "0",
    }, extra);
  }

  // ------------------------------------------------------------------ the views
  let typingTimer = null;
  let controller = null;

  function schedule(delay) {
    clearTimeout(typingTimer);
    typingTimer = setTimeout(() => update().catch(showFailure),
      delay === undefined ? DEBOUNCE_MS : delay);
  }

  async function update() {
    if (!live.text.trim()) {
      showStatus("Type a sentence.");
      return;
    }
    const seq = ++live.seq;
    if (controller) controller.abort();
    controller = new AbortController();
    const started = performance.now();
    const slow = setTimeout(() => showStatus("working\u2026 (the first text loads the model)", true), 300);
    let doc;
    try {
      doc = await api("/api/capture", Object.assign(captureFields(), { weights: "q16", stats: true }),
        controller.signal);
    } catch (error) {
      clearTimeout(slow);
      if (error && error.name === "AbortError") return;
      if (seq === live.seq) showFailure(error);
      return;
    } finally {
      clearTimeout(slow);
    }
    if (seq !== live.seq) return;
    const shown = await show(doc, seq);
    if (!shown) return;
    hideError();
    const parts = [doc.model, doc.tokens.length + " tokens", Math.round(performance.now() - started) + " ms"];
    if (doc.warnings && doc.warnings.length) parts.push(doc.warnings[0]);
    showStatus(parts.join(" \u00b7 "));
    live.updates += 1;
    document.documentElement.dataset.updates = String(live.updates);
    document.documentElement.dataset.ready = "1";
    refreshPanels();
  }

  async function show(doc, seq) {
    const area = byId("report-area");
    const host = el("div", "report-view pending");
    area.appendChild(host);
    const shadow = host.attachShadow({ mode: "open" });
    const style = document.createElement("link");
    style.rel = "stylesheet";
    style.href = "/assets/report.css";
    const styled = new Promise((resolve) => {
      style.addEventListener("load", resolve);
      style.addEventListener("error", resolve);
    });
    const box = el("div", "attnviz embedded");
    box.tabIndex = 0; // focus it to move with the arrow keys
    box.appendChild(byId("report-body").content.cloneNode(true));
    shadow.append(style, box);
    const data = {
      format: "attnviz-report", version: 1, title: "attnviz live: " + doc.model,
      generator: document.querySelector("meta[name=generator]").content, top_k: 5,
      initial: { words: false, special: true }, docs: [doc],
    };
    const mount = attnvizMount(shadow, data, {
      host: area,
      selection: live.selection,
      onChange(selection) {
        if (seq !== live.seq) return;
        const before = JSON.stringify([live.selection.layer, live.selection.heads,
          live.selection.words, live.selection.special]);
        live.selection = selection;
        writeAddress();
        const after = JSON.stringify([selection.layer, selection.heads, selection.words,
          selection.special]);
        if (live.mount === mount && before !== after) schedulePanels();
      },
    });
    try {
      await Promise.all([mount.ready, styled]);
    } catch (error) {
      mount.destroy();
      host.remove();
      throw error;
    }
    if (seq !== live.seq) { // a newer text is on its way
      mount.destroy();
      host.remove();
      return false;
    }
    if (live.mount) live.mount.destroy();
    if (live.host) live.host.remove();
    host.classList.remove("pending");
    live.mount = mount;
    live.host = host;
    if (!live.doc || live.doc.text !== doc.text || live.doc.model !== doc.model) {
      if (live.doc) live.query = null; // a new text: the old row is gone
    }
    live.doc = doc;
    live.selection = mount.selection() || live.selection;
    writeAddress();
    wireView(shadow);
    return true;
  }

  function wireView(shadow) {
    shadow.addEventListener("click", (event) => {
      const token = event.target.closest(".headview .tok");
      if (token) {
        pickQuery(Number(token.dataset.i));
        return;
      }
      const canvas = event.target.closest("#hm-canvas");
      if (canvas && canvas.dataset.cell) {
        const rect = canvas.getBoundingClientRect();
        const row = Math.floor((event.clientY - rect.top - Number(canvas.dataset.y0)) /
          Number(canvas.dataset.cell));
        if (row >= 0 && row < Number(canvas.dataset.n)) pickQuery(row);
      }
    });
  }

  function pickQuery(index) {
    live.query = index;
    writeAddress();
    refreshRow().catch(showFailure);
  }

  // ------------------------------------------------------------------ side panels
  let panelTimer = null;
  let panelSeq = 0;

  function schedulePanels() {
    clearTimeout(panelTimer);
    panelTimer = setTimeout(refreshPanels, PANEL_DEBOUNCE_MS);
  }

  function refreshPanels() {
    refreshTopk().catch(showFailure);
    refreshRow().catch(showFailure);
  }

  function emptyNote(table, title, text) {
    byId(title).textContent = text;
    byId(table).replaceChildren();
  }

  async function refreshTopk() {
    const seq = ++panelSeq;
    if (!live.doc || headChoice() === null) {
      emptyNote("topk-table", "topk-title", "Select a head to see its top keys.");
      return;
    }
    const payload = await api("/api/topk", viewFields({ k: live.k }));
    if (seq !== panelSeq) return;
    byId("topk-title").textContent = payload.title;
    const table = byId("topk-table");
    const head = el("tr");
    head.appendChild(el("th", "w", "#"));
    head.appendChild(el("th", "", "query"));
    for (let rank = 1; rank <= payload.k; rank++) head.appendChild(el("th", "", "top " + rank));
    const rows = [head];
    for (const row of payload.rows) {
      const tr = el("tr", "entry");
      tr.dataset.query = String(row.query_index);
      tr.appendChild(el("td", "w", row.query_index));
      tr.appendChild(el("td", "tok", row.query));
      for (const item of row.top) {
        const td = el("td", "key", item.key + " ");
        td.title = "key " + item.key_index;
        td.dataset.index = String(item.key_index);
        td.appendChild(el("span", "muted w", fmt(item.weight, 3)));
        tr.appendChild(td);
      }
      tr.addEventListener("click", () => pickQuery(row.query_index));
      rows.push(tr);
    }
    table.replaceChildren(...rows);
  }

  let rowSeq = 0;

  async function refreshRow() {
    const seq = ++rowSeq;
    const panel = byId("row-panel");
    const explainPanel = byId("explain-panel");
    if (live.query === null || !live.doc || headChoice() === null) {
      panel.hidden = true;
      explainPanel.hidden = true;
      return;
    }
    let payload;
    try {
      payload = await api("/api/topk", viewFields({ k: ROW_K, query: live.query }));
    } catch (error) {
      if (error instanceof ApiFailure && error.status === 422) { // the token is gone
        live.query = null;
        writeAddress();
        panel.hidden = true;
        explainPanel.hidden = true;
        return;
      }
      throw error;
    }
    if (seq !== rowSeq) return;
    const row = payload.row;
    byId("row-title").textContent = "query " + row.query_index + ": " + row.query + "  \u2014 " +
      payload.title.replace(/, top \d+$/, "");
    const table = byId("row-table");
    const rows = [];
    const head = el("tr");
    for (const [name, cls] of [["#", "w"], ["key", ""], ["weight", "w"], ["", ""]]) head.appendChild(el("th", cls, name));
    rows.push(head);
    row.top.forEach((item, rank) => {
      const tr = el("tr", "entry");
      tr.dataset.index = String(item.key_index);
      tr.appendChild(el("td", "w", rank + 1));
      tr.appendChild(el("td", "tok", item.key_index + ": " + item.key));
      tr.appendChild(el("td", "w", fmt(item.weight)));
      const barCell = el("td", "bar-cell");
      const bar = el("span", "bar");
      bar.style.width = Math.round(Math.max(0, Math.min(1, item.weight)) * 90) + "px";
      barCell.appendChild(bar);
      tr.appendChild(barCell);
      rows.push(tr);
    });
    const total = row.weights.reduce((sum, w) => sum + w, 0);
    const sum = el("tr", "sum");
    sum.appendChild(el("td", "", ""));
    sum.appendChild(el("td", "", "row sum (" + row.weights.length + " keys)"));
    sum.appendChild(el("td", "w", fmt(total)));
    rows.push(sum);
    table.replaceChildren(...rows);
    panel.hidden = false;
    if (isToy()) await refreshExplain(seq, row.query_index);
    else explainPanel.hidden = true;
  }

  async function refreshExplain(seq, query) {
    const choice = headChoice();
    const head = typeof choice === "number" ? choice : (live.selection.heads || [0]).map(Number)[0];
    const payload = await api("/api/explain", {
      text: live.text, model: "toy", token: query, layer: Number(live.selection.layer) || 0,
      head: head || 0, toy: { scale: live.toy.scale, causal: live.toy.causal },
    });
    if (seq !== rowSeq) return;
    const panel = byId("explain-panel");
    const config = payload.config;
    byId("explain-title").textContent = "layer " + payload.layer + ", head " + payload.head +
      (typeof choice === "number" ? "" : " (the first selected head)") + " \u00b7 d_model " +
      config.d_model + ", d_k " + payload.d_k + " \u00b7 " +
      (payload.causal ? "causal" : "bidirectional") + " \u00b7 " +
      (payload.scaling ? "scores \u00d7 1/\u221a" + payload.d_k + " = " + fmt(payload.scale, 3) : "no scaling");
    const body = byId("explain-body");
    const parts = [];
    const q = payload.query_index;
    const step1 = el("div", "step");
    step1.appendChild(el("h3", "", "1. q = x W_Q for \u201c" + payload.query + "\u201d (position " + q + ")"));
    step1.appendChild(el("div", "vector", "[" + payload.q[q].map((v) => fmt(v, 3)).join(", ") + "]"));
    parts.push(step1);
    const step2 = el("div", "step");
    step2.appendChild(el("h3", "", "2. scores q\u00b7k, scaled, softmax"));
    const table = el("table", "numbers explain-table");
    const header = el("tr");
    for (const [name, cls] of [["key", ""], ["q\u00b7k", "w"], [payload.scaling ? "scaled" : "scaled (= q\u00b7k)", "w"], ["weight", "w"], ["", ""]]) {
      header.appendChild(el("th", cls, name));
    }
    table.appendChild(header);
    payload.tokens.forEach((token, j) => {
      const masked = payload.masked[j];
      const tr = el("tr", masked ? "masked" : j === q ? "query" : "");
      tr.dataset.index = String(j);
      tr.appendChild(el("td", "tok", j + ": " + token));
      tr.appendChild(el("td", "w", fmt(payload.scores[j], 3)));
      tr.appendChild(el("td", "w", masked ? "masked (\u2212\u221e)" : fmt(payload.scaled[j], 3)));
      tr.appendChild(el("td", "w weight", fmt(payload.weights[j])));
      const barCell = el("td", "bar-cell");
      const bar = el("span", "bar");
      bar.style.width = Math.round(Math.max(0, Math.min(1, payload.weights[j] || 0)) * 90) + "px";
      barCell.appendChild(bar);
      tr.appendChild(barCell);
      table.appendChild(tr);
    });
    const sum = el("tr", "sum");
    sum.appendChild(el("td", "", "sum"));
    sum.appendChild(el("td", "", ""));
    sum.appendChild(el("td", "", ""));
    sum.appendChild(el("td", "w", fmt(payload.weights_sum)));
    table.appendChild(sum);
    step2.appendChild(table);
    parts.push(step2);
    const step3 = el("div", "step");
    step3.appendChild(el("h3", "", "3. output = \u03a3 weight\u2c7c \u00b7 v\u2c7c (before W_O)"));
    step3.appendChild(el("div", "vector", "[" + payload.output.map((v) => fmt(v, 3)).join(", ") + "]"));
    parts.push(step3);
    let best = 0;
    payload.weights.forEach((w, j) => { if ((w || 0) > (payload.weights[best] || 0)) best = j; });
    const other = Math.max(...payload.other_scaling_weights.map((w) => w || 0));
    parts.push(el("p", "note", payload.scaling
      ? "Largest weight " + fmt(payload.weights[best], 3) + " on \u201c" + payload.tokens[best] +
        "\u201d. Without 1/\u221ad_k it would be " + fmt(other, 3) + ": unscaled scores grow " +
        "with d_k and push the softmax towards one-hot."
      : "Largest weight " + fmt(payload.weights[best], 3) + " on \u201c" + payload.tokens[best] +
        "\u201d. With 1/\u221ad_k it would be " + fmt(other, 3) + "."));
    body.replaceChildren(...parts);
    panel.hidden = false;
  }

  // ------------------------------------------------------------------ downloads
  // ------------------------------------------------------------------ generation
  // POST /api/generate answers one JSON line per generated token as the model chooses it;
  // each becomes a row of the panel at once (its position, the token, its strongest keys).
  // While it runs the button reads "Stop": stopping aborts the request, and the server, which
  // sees the connection close, ends the generation at the next token and frees the model.
  let generating = null;

  function generateButton(running) {
    const button = byId("generate");
    button.textContent = running ? "Stop" : "Generate";
    button.title = running ? "Stop the generation (the tokens so far stay)"
      : "Continue the text with the model; each token shows the context tokens it attended to most, as it comes";
    byId("generate-panel").dataset.running = running ? "1" : "0";
  }

  function stopGenerate() {
    if (!generating) return;
    const controller = generating;
    generating = null;
    controller.abort();
    generateButton(false);
    byId("generate-panel").dataset.stopped = "1";
    showStatus("generation stopped");
  }

  async function runGenerate() {
    if (generating) generating.abort();
    const controller = new AbortController();
    generating = controller;
    delete byId("generate-panel").dataset.stopped;
    generateButton(true);
    const layer = live.selection.layer === undefined ? -1 : Number(live.selection.layer);
    const choice = headChoice();
    const head = typeof choice === "number" ? choice : "mean";
    const k = Math.max(1, Math.min(20, Number(byId("k").value) || 3));
    const body = { text: live.text, model: live.model || undefined, layer, head, k,
      max_new_tokens: Math.max(1, Number(byId("new-tokens").value) || 12) };
    const table = byId("generate-table");
    const shown = byId("generate-text");
    table.replaceChildren();
    shown.textContent = "";
    byId("generate-title").textContent = "layer " + layer + ", " +
      (head === "mean" ? "mean of the heads" : "head " + head) + ", top " + k;
    hideError();
    try {
      const response = await request("POST", "/api/generate", body, controller.signal);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 1);
          if (line.trim()) showGenerated(JSON.parse(line));
        }
      }
    } catch (error) {
      if (!(error && error.name === "AbortError")) showFailure(error);
    } finally {
      if (generating === controller) {
        generating = null;
        generateButton(false);
      }
    }
  }

  function showGenerated(item) {
    if (item.error) throw new ApiFailure(item.error.status, item.error);
    if (item.done) {
      byId("generate-text").textContent = item.text;
      byId("generate-panel").dataset.done = String(item.steps);
      return;
    }
    const tr = el("tr");
    tr.dataset.step = String(item.step);
    const tops = el("td");
    for (const top of item.top) {
      tops.append(el("span", "key", top.key_index + ":" + top.key + " " + fmt(top.weight, 3)));
    }
    tr.append(el("td", "pos", item.position), el("td", "tok", item.token), tops);
    byId("generate-table").append(tr);
    byId("generate-text").textContent += (item.step ? " " : "") + item.token;
  }

  async function download(path, body, fallback) {
    const response = await request("POST", path, body);
    const blob = await response.blob();
    const match = /filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "");
    const url = URL.createObjectURL(blob);
    const link = el("a");
    link.href = url;
    link.download = match ? match[1] : fallback;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 30000);
  }

  // ------------------------------------------------------------------ models
  async function loadModels() {
    const info = await (await request("GET", "/api/models")).json();
    live.models = info.models.map((m) => m.name);
    live.allowAny = !!info.allow_any_model;
    const select = byId("model");
    const names = live.models.slice();
    if (live.model && !names.includes(live.model)) {
      if (live.allowAny) {
        names.push(live.model);
      } else {
        showFailure(new ApiFailure(404, { message: "model " + JSON.stringify(live.model) +
          " is not served here: showing " + info.default,
          hint: "this server has " + live.models.join(", ") }));
        live.model = "";
      }
    }
    select.replaceChildren(...names.map((name) => {
      const option = el("option", "", name);
      option.value = name;
      return option;
    }));
    if (!live.model) live.model = info.default;
    select.value = live.model;
    syncToy();
    const long = byId("long-link");
    if (info.long && long) {  // a long capture this server was started with (--long-from)
      long.textContent = "Long context (" + info.long.num_tokens.toLocaleString() + " tokens) \u2192";
      long.hidden = false;
    }
  }

  function syncToy() {
    byId("toy-options").hidden = !isToy();
    byId("toy-scale").checked = live.toy.scale;
    byId("toy-causal").checked = live.toy.causal;
    byId("measure-option").hidden = isToy(); // the toy model has attention weights only
    byId("measure").value = live.measure;
  }

  // ------------------------------------------------------------------ wiring
  function wire() {
    byId("input-form").addEventListener("submit", (event) => event.preventDefault());
    const text = byId("text");
    const pair = byId("pair");
    text.value = live.text;
    pair.value = live.pair;
    text.addEventListener("input", () => {
      live.text = text.value;
      writeAddress();
      schedule();
    });
    pair.addEventListener("input", () => {
      live.pair = pair.value;
      writeAddress();
      schedule();
    });
    byId("model").addEventListener("change", (event) => {
      live.model = event.target.value;
      live.query = null;
      // Another model has other layers and heads: start from its defaults (all heads).
      delete live.selection.layer;
      delete live.selection.heads;
      syncToy();
      writeAddress();
      schedule(0);
    });
    byId("measure").addEventListener("change", (event) => {
      live.measure = event.target.value;
      live.query = null;
      writeAddress();
      schedule(0);
    });
    for (const [id, key] of [["toy-scale", "scale"], ["toy-causal", "causal"]]) {
      byId(id).addEventListener("change", (event) => {
        live.toy[key] = event.target.checked;
        writeAddress();
        schedule(0);
      });
    }
    const k = byId("k");
    k.value = String(live.k);
    k.addEventListener("change", () => {
      const value = Math.round(Number(k.value));
      live.k = Number.isFinite(value) ? Math.max(1, Math.min(20, value)) : 3;
      k.value = String(live.k);
      writeAddress();
      refreshTopk().catch(showFailure);
    });
    byId("download-zip").addEventListener("click", () => {
      download("/api/capture.zip", captureFields(), "attnviz_capture.zip").catch(showFailure);
    });
    byId("download-csv").addEventListener("click", () => {
      if (headChoice() === null) {
        showFailure(new Error("select a head first"));
        return;
      }
      download("/api/topk", viewFields({ k: live.k, format: "csv" }), "attnviz_topk.csv").catch(showFailure);
    });
    byId("generate").addEventListener("click", () => {
      if (generating) {
        stopGenerate();
        return;
      }
      delete byId("generate-panel").dataset.done;
      runGenerate().catch(showFailure);
    });
    byId("copy-link").addEventListener("click", () => {
      writeAddress();
      const done = () => showStatus("link copied");
      if (navigator.clipboard && navigator.clipboard.writeText) {
        navigator.clipboard.writeText(location.href).then(done, () => showStatus("copy the address bar: it holds the link"));
      } else {
        showStatus("copy the address bar: it holds the link");
      }
    });
    window.addEventListener("hashchange", () => {
      if (location.hash === live.lastHash) return;
      readAddress(); // a link pasted into this tab: show what it says
      text.value = live.text;
      pair.value = live.pair;
      byId("model").value = live.model;
      syncToy();
      if (live.mount) live.mount.set(live.selection);
      schedule(0);
    });
  }

  async function main() {
    readAddress();
    wire();
    try {
      await loadModels();
    } catch (error) {
      showFailure(error);
      return;
    }
    await update();
  }

  main().catch(showFailure);
})();
