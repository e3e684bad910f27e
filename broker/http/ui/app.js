// Skred management UI: one page of plain JavaScript over the JSON API under /api/.
//
// How it works: the hash names the page (#/queues, #/queues/<vhost>/<name>, ...). A page builds
// its static parts once (headings, forms) and returns a refresh() that re-reads the API and
// replaces only its live parts (tables, cards, charts), so the 5-second auto-refresh never wipes
// what the user is typing. Every datum comes from the API with the user's credentials: the API
// decides what a user may see or change, and the UI shows the API's refusal when it says no.
// Text from the broker is always inserted as text nodes (h() below), never as HTML.
"use strict";
(() => {
  const Prefs = window.SkredPrefs; // prefs.js: remembered choices and history ranges
  const HISTORY_MS = 10 * 60 * 1000; // charts keep the last ten minutes of samples
  const PAGE_SIZES = [20, 50, 100, 500];
  const COLORS = ["#0b6bcb", "#1e7b34", "#c26a00", "#8a3ffc", "#b3261e", "#00838f"];

  // auth: basic-auth credentials or an OAuth 2 access token (scheme "Bearer"), the tab's alone
  const state = { auth: sessionStorage.getItem("skred.auth"), scheme: sessionStorage.getItem("skred.scheme") || "Basic",
                  sso: null, user: null, refresh: null, timer: null, page: 0 };
  const enc = encodeURIComponent;
  const $ = (sel) => document.querySelector(sel);

  // ------------------------------------------------------------------ DOM helpers
  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "class") el.className = v;
      else if (k === "value") el.value = v;
      else if (k === "style") el.style.cssText = v; // CSSOM, which the page's CSP allows (style attributes it does not)
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }
  const link = (href, text) => h("a", { href }, text);
  const get = (obj, path) => path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
  const num = (v) => (v == null ? "" : Number(v).toLocaleString("en-US"));
  const rate = (v) => (v == null ? "" : `${Number(v).toFixed(1)}/s`);
  const bytes = (v) => {
    if (v == null) return "";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, n = Number(v);
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  };
  const yes = (v) => (v ? "yes" : "no");
  const json = (v) => JSON.stringify(v ?? {}, null, 0);
  const isAdmin = () => !!state.user && state.user.tags.includes("administrator");

  function toast(text) {
    const t = $("#toast");
    t.textContent = text;
    t.classList.add("show");
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => t.classList.remove("show"), 3500);
  }

  // ------------------------------------------------------------------ the API
  class ApiError extends Error {
    constructor(status, reason) { super(reason); this.status = status; }
  }

  async function api(method, path, body) {
    const headers = { "X-Requested-With": "XMLHttpRequest", Authorization: `${state.scheme} ${state.auth}` };
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = typeof body === "string" ? body : JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    const text = await resp.text();
    let data = null;
    if (text) { try { data = JSON.parse(text); } catch { data = text; } }
    if (!resp.ok) {
      const reason = (data && data.reason) || resp.statusText || `HTTP ${resp.status}`;
      // The API answers a refusal with 401 as RabbitMQ does, but challenges (WWW-Authenticate)
      // only bad credentials: an unchallenged 401 is a refusal, shown like a 403.
      const challenged = resp.status === 401 && (resp.headers.has("X-Skred-Challenge") || resp.headers.has("WWW-Authenticate"));
      if (challenged && state.user) logout("Your login is no longer accepted; log in again.");
      throw new ApiError(resp.status === 401 && !challenged ? 403 : resp.status, reason);
    }
    return data;
  }

  // Runs a change through the API and reports the result; the page refreshes afterwards.
  async function act(what, fn) {
    try {
      await fn();
      toast(what);
      if (state.refresh) await state.refresh();
      return true;
    } catch (e) {
      toast(`Refused: ${e.message}`);
      return false;
    }
  }

  // ------------------------------------------------------------------ login
  function showLogin(message) {
    stopTimer();
    $("#top").hidden = true;
    const error = h("p", { class: "error", id: "login-error", role: "alert" }, message || "");
    const user = h("input", { type: "text", id: "username", autocomplete: "username", required: true });
    const pass = h("input", { type: "password", id: "password", autocomplete: "current-password" });
    const form = h("form", { id: "login" },
      h("h1", {}, "Skred management"),
      h("label", { for: "username" }, "Username"), user,
      h("label", { for: "password" }, "Password"), pass,
      h("button", { type: "submit", class: "primary", id: "login-button" }, "Log in"),
      state.sso && h("button", { type: "button", id: "oauth-login", onclick: () => ssoStart() },
        `Sign in with ${state.sso.oauth_provider_name}`),
      error);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      state.auth = btoa(String.fromCharCode(...new TextEncoder().encode(`${user.value}:${pass.value}`)));
      try {
        state.user = await api("GET", "/api/whoami");
      } catch (e) {
        state.auth = null;
        error.textContent = e.status === 401 ? "Login failed: wrong user name or password, or the user has no management tag." : `Login failed: ${e.message}`;
        return;
      }
      remember("Basic");
    });
    $("#main").replaceChildren(form);
    user.focus();
  }

  function remember(scheme) {
    state.scheme = scheme;
    sessionStorage.setItem("skred.auth", state.auth);
    sessionStorage.setItem("skred.scheme", scheme);
    if (!location.hash || location.hash === "#/login") location.hash = "#/overview";
    started();
  }

  function logout(message) {
    const sso = state.scheme === "Bearer" && state.sso;
    state.auth = null;
    state.user = null;
    state.scheme = "Basic";
    sessionStorage.removeItem("skred.auth");
    sessionStorage.removeItem("skred.scheme");
    if (sso && sso.oauth_end_session_endpoint && !message) { // end the provider's session too
      const q = new URLSearchParams({ client_id: sso.oauth_client_id, post_logout_redirect_uri: `${location.origin}/` });
      location.assign(`${sso.oauth_end_session_endpoint}?${q}`);
      return;
    }
    showLogin(message || "Logged out.");
  }

  // ------------------------------------------------------------------ single sign-on
  // OpenID Connect's authorization-code flow with PKCE (S256): the page sends the browser to the
  // provider with a challenge, gets a code back on "/", and the broker's relay
  // (POST /api/oauth/token) trades code + verifier for an access token (http/routes_oauth.py).
  const b64url = (bytes) => btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");

  async function ssoStart() {
    const sso = state.sso;
    const verifier = b64url(crypto.getRandomValues(new Uint8Array(32)));
    const nonce = b64url(crypto.getRandomValues(new Uint8Array(16)));
    const challenge = b64url(new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier))));
    sessionStorage.setItem("skred.oauth", JSON.stringify({ verifier, state: nonce }));
    const q = new URLSearchParams({
      response_type: "code", client_id: sso.oauth_client_id, redirect_uri: `${location.origin}/`,
      scope: sso.oauth_scopes, state: nonce, code_challenge: challenge, code_challenge_method: "S256",
    });
    location.assign(`${sso.oauth_authorization_endpoint}?${q}`);
  }

  // Back from the provider (?code=...&state=...): a token, or the login form with the reason.
  async function ssoFinish() {
    const params = new URLSearchParams(location.search);
    const pending = JSON.parse(sessionStorage.getItem("skred.oauth") || "null");
    sessionStorage.removeItem("skred.oauth");
    history.replaceState(null, "", "/#/overview"); // the code never stays in the address bar
    if (params.get("error")) return `Sign-in refused by the provider: ${params.get("error")}`;
    if (!pending || pending.state !== params.get("state")) return "Sign-in failed: it was not started here.";
    try {
      const resp = await fetch("/api/oauth/token", {
        method: "POST", cache: "no-store",
        headers: { "Content-Type": "application/json", "X-Requested-With": "XMLHttpRequest" },
        body: JSON.stringify({ code: params.get("code"), code_verifier: pending.verifier, redirect_uri: `${location.origin}/` }),
      });
      const data = await resp.json();
      if (!resp.ok) return `Sign-in failed: ${data.reason || resp.status}`;
      state.auth = data.access_token;
      state.scheme = "Bearer";
      state.user = await api("GET", "/api/whoami");
    } catch (e) {
      state.auth = null;
      state.scheme = "Basic";
      return `Sign-in failed: ${e.message}`;
    }
    remember("Bearer");
    return null;
  }

  function started() {
    $("#top").hidden = false;
    $("#who").textContent = `${state.user.name} (${state.user.tags.join(", ") || "no tags"})`;
    for (const a of document.querySelectorAll("[data-admin]")) a.hidden = !isAdmin();
    headerChoices();
    route().finally(vhostChoices);
  }

  // ------------------------------------------------------------------ refresh loop
  function stopTimer() { clearInterval(state.timer); state.timer = null; }

  // The interval is the user's (header, remembered); 0 stops the refresh.
  function startTimer() {
    stopTimer();
    const seconds = Prefs.get("interval");
    if (!seconds) return;
    state.timer = setInterval(() => {
      if (state.refresh && !document.hidden) state.refresh().catch(() => {});
    }, seconds * 1000);
  }

  // ------------------------------------------------------------------ charts
  // A chart keeps samples (time, {series: value}) and draws them as SVG polylines: added one at
  // a time as the page refreshes (add), or all at once from the server's history (set).
  function chart(title, series) {
    const samples = [];
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 600 180");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", title);
    const scale = h("span", { class: "muted" });
    const legendValues = series.map(() => h("span"));
    const legend = h("div", { class: "legend" }, series.map(([, label], i) =>
      h("span", {}, h("i", { style: `background:${COLORS[i % COLORS.length]}` }), `${label}: `, legendValues[i])));
    const root = h("div", { class: "chart" }, h("div", {}, h("strong", {}, title), " ", scale), svg, legend);
    function add(values) {
      const now = Date.now();
      samples.push([now, values]);
      while (samples.length && samples[0][0] < now - HISTORY_MS) samples.shift();
      // The time axis grows with the history: one minute at first, ten at most.
      draw(now, Math.min(HISTORY_MS, Math.max(60000, now - samples[0][0])), values);
    }
    function set(rows) { // [[ms, values], ...] oldest first, over the range picked in the header
      samples.splice(0, samples.length, ...rows);
      if (!rows.length) return;
      const now = rows[rows.length - 1][0];
      draw(now, Prefs.range()[0] * 1000, rows[rows.length - 1][1]); // the range asked, not the points' span
    }
    function draw(now, span, values) {
      const max = Math.max(1, ...samples.flatMap(([, v]) => series.map(([key]) => Number(v[key]) || 0)));
      const label = Prefs.RANGES.find(([age]) => age * 1000 === span);
      scale.textContent = `(0 to ${num(Math.ceil(max))}, ${label ? label[2].toLowerCase() : `last ${Math.round(span / 60000)} min`})`;
      svg.replaceChildren();
      const t0 = now - span;
      series.forEach(([key], i) => {
        const pts = samples.map(([t, v]) => `${((t - t0) / span) * 600},${176 - ((Number(v[key]) || 0) / max) * 170}`);
        if (pts.length === 1) pts.unshift(`${pts[0].split(",")[0] - 4},${pts[0].split(",")[1]}`);
        const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
        line.setAttribute("points", pts.join(" "));
        line.setAttribute("fill", "none");
        line.setAttribute("stroke", COLORS[i % COLORS.length]);
        line.setAttribute("stroke-width", "2");
        line.setAttribute("vector-effect", "non-scaling-stroke");
        svg.append(line);
        legendValues[i].textContent = num(Math.round((Number(values[key]) || 0) * 10) / 10);
      });
    }
    return { root, add, set };
  }

  const RATE_SERIES = [["publish", "published/s"], ["confirm", "confirmed/s"], ["deliver_get", "delivered/s"],
    ["ack", "acked/s"], ["redeliver", "redelivered/s"]];
  const RATE_KEYS = RATE_SERIES.map(([k]) => k);
  // a channel's own counters (GET /api/channels/{name}: its message_stats), deliver_get split as
  // RabbitMQ's channel page shows it
  const CHANNEL_SERIES = [["publish", "published/s"], ["confirm", "confirmed/s"],
    ["deliver", "delivered (manual ack)/s"], ["deliver_no_ack", "delivered (auto ack)/s"],
    ["get", "got (manual ack)/s"], ["get_no_ack", "got (auto ack)/s"], ["ack", "acked/s"],
    ["redeliver", "redelivered/s"]];
  const LENGTH_SERIES = [["messages_ready", "ready"], ["messages_unacknowledged", "unacked"]];
  const LENGTH_KEYS = LENGTH_SERIES.map(([k]) => k);
  // A path with the header's chart range: the answer carries *_details samples over it.
  const ranged = (path) => `${path}${path.includes("?") ? "&" : "?"}${Prefs.rangeQuery()}`;

  // ------------------------------------------------------------------ tables
  // cols: [key, label, render?, numeric?]; a key is also the server-side sort key.
  function table(cols, rows, opts = {}) {
    const head = h("tr", {}, cols.map(([key, label, , numeric]) => {
      const sortable = opts.onSort && key;
      const mark = opts.sort === key ? (opts.reverse ? " \u25be" : " \u25b4") : "";
      return h("th", { class: numeric ? "num" : null, scope: "col", "aria-sort": opts.sort === key ? (opts.reverse ? "descending" : "ascending") : null },
        sortable ? h("button", { type: "button", onclick: () => opts.onSort(key) }, label + mark) : label);
    }));
    const body = rows.length
      ? rows.map((r) => h("tr", {}, cols.map(([key, , render, numeric]) =>
        h("td", { class: numeric ? "num" : null }, render ? render(r) : String(get(r, key) ?? "")))))
      : [h("tr", {}, h("td", { colspan: cols.length, class: "muted" }, opts.empty || "Nothing here."))];
    return h("table", {}, h("thead", {}, head), h("tbody", {}, body));
  }

  function kv(pairs) {
    return h("dl", { class: "kv" }, pairs.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "")]));
  }

  // A paged, filtered, sorted list backed by the API's own paging (page, page_size, name,
  // use_regex, sort, sort_reverse), so 10,000 queues cost one page, not the whole list.
  function pagedList(path, cols, opts = {}) {
    const s = { page: 1, size: 50, filter: "", sort: opts.sort || "name", reverse: false };
    const live = h("div");
    const filter = h("input", { type: "text", placeholder: "Filter by name (regular expression)", "aria-label": "Filter by name", style: "max-width:24rem" });
    let debounce;
    filter.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(() => { s.filter = filter.value; s.page = 1; refresh(); }, 250); });
    const size = h("select", { "aria-label": "Rows per page", onchange: () => { s.size = Number(size.value); s.page = 1; refresh(); } },
      PAGE_SIZES.map((n) => h("option", { value: n, selected: n === s.size }, `${n} per page`)));
    const root = h("div", {}, h("div", { class: "bar" }, filter, size), live);
    let asked = 0; // answers can arrive out of order (typing, auto-refresh): only the newest is shown
    async function refresh() {
      const mine = ++asked;
      const q = new URLSearchParams({ page: s.page, page_size: s.size, sort: s.sort, sort_reverse: s.reverse });
      if (s.filter) { q.set("name", s.filter); q.set("use_regex", "true"); }
      let data;
      try {
        data = await api("GET", `${path}${path.includes("?") ? "&" : "?"}${q}`);
      } catch (e) {
        if (mine === asked) live.replaceChildren(h("p", { class: "error" }, e.message));
        return;
      }
      if (mine !== asked) return;
      const items = Array.isArray(data) ? data : data.items;
      const rows = opts.where ? items.filter(opts.where) : items;
      const pageCount = data.page_count || 1;
      const pager = h("div", { class: "pager" },
        h("button", { type: "button", disabled: s.page <= 1, onclick: () => { s.page--; refresh(); } }, "\u2039 Previous"),
        h("span", {}, `Page ${s.page} of ${pageCount} \u00b7 ${num(data.filtered_count ?? rows.length)} matching of ${num(data.total_count ?? rows.length)}`),
        h("button", { type: "button", disabled: s.page >= pageCount, onclick: () => { s.page++; refresh(); } }, "Next \u203a"));
      live.replaceChildren(table(typeof cols === "function" ? cols() : cols, rows, {
        sort: s.sort, reverse: s.reverse, empty: opts.empty,
        onSort: (key) => { s.reverse = s.sort === key ? !s.reverse : false; s.sort = key; s.page = 1; refresh(); },
      }), pager);
    }
    return { root, refresh };
  }

  // ------------------------------------------------------------------ forms
  // fields: [name, label, type ("text"|"password"|"number"|"textarea"|"checkbox"|select options array), default]
  function form(id, title, fields, submitLabel, onSubmit) {
    const inputs = {};
    const rows = fields.map(([name, label, type, value]) => {
      const fid = `${id}-${name}`;
      let input;
      if (Array.isArray(type)) input = h("select", { id: fid, name }, type.map((o) => h("option", { value: o, selected: o === value }, o)));
      else if (type === "textarea") input = h("textarea", { id: fid, name }, value || "");
      else if (type === "checkbox") input = h("input", { id: fid, name, type: "checkbox", checked: !!value });
      else input = h("input", { id: fid, name, type: type || "text", value: value ?? "" });
      inputs[name] = input;
      return [h("label", { for: fid }, label), input];
    });
    const error = h("div", { class: "error full", role: "alert" });
    const el = h("form", { class: "stack", id }, rows, h("div", { class: "full" }, h("button", { type: "submit", class: "primary" }, submitLabel)), error);
    el.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      error.textContent = "";
      const values = Object.fromEntries(Object.entries(inputs).map(([k, i]) => [k, i.type === "checkbox" ? i.checked : i.value]));
      try {
        await onSubmit(values);
      } catch (e) {
        error.textContent = e.message;
      }
    });
    return h("section", {}, title ? h("h2", {}, title) : null, el);
  }

  function parseJson(text, what) {
    if (!text.trim()) return {};
    try { return JSON.parse(text); } catch { throw new Error(`${what} is not valid JSON`); }
  }

  function parseValue(text) {
    if (/^-?\d+$/.test(text)) return Number(text);
    return text;
  }

  // The publish form of a queue (default exchange, routing key = queue) or an exchange.
  function publishForm(vhost, exchange, routingKey) {
    return form("publish", "Publish a message", [
      ["routing_key", "Routing key", "text", routingKey || ""],
      ["delivery_mode", "Delivery mode", ["2 (persistent)", "1 (transient)"], "2 (persistent)"],
      ["headers", "Headers (JSON object)", "text", ""],
      ["properties", "Other properties (JSON, e.g. {\"content_type\": \"text/plain\"})", "text", ""],
      ["payload", "Payload", "textarea", ""],
      ["payload_encoding", "Payload encoding", ["string", "base64"], "string"],
    ], "Publish message", async (v) => {
      const properties = parseJson(v.properties, "Properties");
      properties.delivery_mode = Number(v.delivery_mode[0]);
      const headers = parseJson(v.headers, "Headers");
      if (Object.keys(headers).length) properties.headers = headers;
      const res = await api("POST", `/api/exchanges/${enc(vhost)}/${enc(exchange || "amq.default")}/publish`,
        { properties, routing_key: v.routing_key, payload: v.payload, payload_encoding: v.payload_encoding });
      toast(res && res.routed ? "Message published." : "Message published, but it was not routed to any queue.");
      if (state.refresh) await state.refresh();
    });
  }

  function bindingForm(vhost, fixed) {
    // fixed: {source} (exchange page) or {destination, destination_type: "q"} (queue page)
    const fields = [];
    if (!fixed.source) fields.push(["source", "From exchange", "text", ""]);
    if (!fixed.destination) {
      fields.push(["destination_type", "To", ["queue", "exchange"], "queue"]);
      fields.push(["destination", "Destination name", "text", ""]);
    }
    fields.push(["routing_key", "Routing key", "text", ""], ["arguments", "Arguments (JSON object)", "text", ""]);
    return form("bind", "Add binding", fields, "Bind", async (v) => {
      const src = fixed.source || v.source;
      const dest = fixed.destination || v.destination;
      const kind = fixed.destination ? "q" : v.destination_type === "exchange" ? "e" : "q";
      await api("POST", `/api/bindings/${enc(vhost)}/e/${enc(src)}/${kind}/${enc(dest)}`,
        { routing_key: v.routing_key, arguments: parseJson(v.arguments, "Arguments") });
      toast("Binding added.");
      if (state.refresh) await state.refresh();
    });
  }

  function unbindButton(b) {
    const kind = b.destination_type === "exchange" ? "e" : "q";
    const url = `/api/bindings/${enc(b.vhost)}/e/${enc(b.source)}/${kind}/${enc(b.destination)}/${enc(b.properties_key)}`;
    return b.source === "" ? h("span", { class: "muted" }, "default")
      : h("button", { type: "button", class: "danger", onclick: () => act("Binding removed.", () => api("DELETE", url)) }, "Unbind");
  }

  const BINDING_COLS = [["source", "From", (b) => (b.source === "" ? "(default exchange)" : link(`#/exchanges/${enc(b.vhost)}/${enc(b.source)}`, b.source))],
    ["destination", "To", (b) => link(`#/${b.destination_type === "exchange" ? "exchanges" : "queues"}/${enc(b.vhost)}/${enc(b.destination)}`, `${b.destination} (${b.destination_type})`)],
    ["routing_key", "Routing key"], ["arguments", "Arguments", (b) => json(b.arguments)], ["", "", unbindButton]];

  function confirmButton(label, question, what, fn, after) {
    return h("button", { type: "button", class: "danger", onclick: async () => {
      if (!window.confirm(question)) return;
      if (await act(what, fn) && after) after();
    } }, label);
  }

  // ------------------------------------------------------------------ pages
  function page(title, ...parts) {
    $("#main").replaceChildren(h("h1", {}, title), ...parts);
  }

  // The overview's charts live as long as the page is open, so their history survives navigation.
  let overviewCharts = null;

  async function overviewPage() {
    const cards = h("div", { class: "cards", id: "totals" });
    overviewCharts = overviewCharts || [chart("Message rates", RATE_SERIES), chart("Queued messages", LENGTH_SERIES)];
    const [rateChart, queuedChart] = overviewCharts;
    const nodes = h("div");
    const cluster = h("div", { id: "cluster" });
    page("Overview", cards, h("div", { class: "bar" }, rateChart.root, queuedChart.root), h("h2", {}, "Nodes"), nodes, cluster);
    return async () => {
      const [o, ns] = await Promise.all([api("GET", ranged("/api/overview")), api("GET", "/api/nodes").catch(() => [])]);
      const t = o.object_totals || {}, q = o.queue_totals || {};
      const card = (k, v, id) => h("div", { class: "card", id }, h("div", { class: "v" }, num(v ?? 0)), h("div", { class: "k" }, k));
      cards.replaceChildren(card("Connections", t.connections, "total-connections"), card("Channels", t.channels, "total-channels"),
        card("Exchanges", t.exchanges, "total-exchanges"), card("Queues", t.queues, "total-queues"), card("Consumers", t.consumers, "total-consumers"),
        card("Ready", q.messages_ready, "total-ready"), card("Unacked", q.messages_unacknowledged, "total-unacked"), card("Total messages", q.messages, "total-messages"));
      rateChart.set(Prefs.series(o.message_stats, RATE_KEYS, true));
      queuedChart.set(Prefs.series(q, LENGTH_KEYS, false));
      nodes.replaceChildren(table([["name", "Node", (n) => link(`#/nodes/${enc(n.name)}`, n.name)], ["uptime", "Uptime", (n) => `${Math.round((n.uptime || 0) / 60000)} min`],
        ["mem_used", "Memory", (n) => `${bytes(n.mem_used)}${n.mem_limit ? ` of ${bytes(n.mem_limit)}` : ""}`],
        ["mem_alarm", "Memory alarm", (n) => h("span", { class: n.mem_alarm ? "bad" : "ok" }, n.mem_alarm ? "ALARM" : "ok")],
        ["disk_free", "Disk free", (n) => `${bytes(n.disk_free)} (limit ${bytes(n.disk_free_limit)})`],
        ["disk_free_alarm", "Disk alarm", (n) => h("span", { class: n.disk_free_alarm ? "bad" : "ok" }, n.disk_free_alarm ? "ALARM" : "ok")],
        ["fd_used", "File descriptors", (n) => `${num(n.fd_used)} / ${num(n.fd_total)}`]], ns));
      let c = null;
      try { c = await api("GET", "/api/cluster"); } catch { c = null; }
      if (!c || !c.enabled) { cluster.replaceChildren(); return; }
      const parts = [h("h2", {}, "Cluster"), kv([["This node", `${c.node_id} (${c.role})`],
        ["Leader", h("span", { id: "cluster-leader" }, c.leader && (c.leader.node_id || c.leader.uri) || "none")],
        ["In-sync replicas", (c.isr || []).join(", ")]])];
      if (c.followers) {
        parts.push(h("h2", {}, "Followers"), table([["node_id", "Follower"], ["peer", "Address"], ["lag_bytes", "Lag", (f) => bytes(f.lag_bytes), true],
          ["synced", "Synced", (f) => yes(f.synced)], ["in_isr", "In ISR", (f) => yes(f.in_isr)]], c.followers));
      }
      cluster.replaceChildren(...parts);
    };
  }

  const LISTS = {
    connections: {
      title: "Connections", path: "/api/connections",
      cols: [["name", "Name", (r) => link(`#/connections/${enc(r.name)}`, r.name)], ["user", "User"], ["vhost", "Virtual host"],
        ["protocol", "Protocol"], ["client_properties.product", "Client", (r) => get(r, "client_properties.product") || get(r, "client_properties.client_id") || ""],
        ["channels", "Channels", null, true],
        ["ssl", "TLS", (r) => yes(r.ssl)], ["state", "State"]],
    },
    channels: {
      title: "Channels", path: "/api/channels",
      cols: [["name", "Channel", (r) => link(`#/channels/${enc(r.name)}`, r.name)], ["user", "User"], ["vhost", "Virtual host"], ["consumer_count", "Consumers", null, true],
        ["prefetch_count", "Prefetch", null, true], ["messages_unacknowledged", "Unacked", null, true],
        ["confirm", "Mode", (r) => (r.confirm ? "confirm" : r.transactional ? "tx" : "")], ["state", "State"]],
    },
    exchanges: {
      title: "Exchanges", path: "/api/exchanges",
      cols: [["name", "Name", (r) => link(`#/exchanges/${enc(r.vhost)}/${enc(r.name || "amq.default")}`, r.name || "(AMQP default)")],
        ["vhost", "Virtual host"], ["type", "Type"], ["durable", "Durable", (r) => yes(r.durable)], ["policy", "Policy"],
        ["message_stats.publish_in_details.rate", "Rate in", (r) => rate(get(r, "message_stats.publish_in_details.rate")), true]],
      create: () => form("add-exchange", "Add an exchange", [["vhost", "Virtual host", "text", "/"], ["name", "Name", "text", ""],
        ["type", "Type", ["direct", "fanout", "topic", "headers", "x-delayed-message", "x-consistent-hash"], "direct"],
        ["durable", "Durable", "checkbox", true], ["arguments", "Arguments (JSON object)", "text", ""]], "Add exchange", async (v) => {
        await api("PUT", `/api/exchanges/${enc(v.vhost)}/${enc(v.name)}`, { type: v.type, durable: v.durable, auto_delete: false, internal: false, arguments: parseJson(v.arguments, "Arguments") });
        toast("Exchange added.");
        await state.refresh();
      }),
    },
    queues: {
      title: "Queues", path: "/api/queues",
      cols: [["name", "Name", (r) => link(`#/queues/${enc(r.vhost)}/${enc(r.name)}`, r.name)], ["vhost", "Virtual host"], ["type", "Type"],
        ["state", "State"], ["messages_ready", "Ready", (r) => num(r.messages_ready), true],
        ["messages_unacknowledged", "Unacked", (r) => num(r.messages_unacknowledged), true], ["messages", "Total", (r) => num(r.messages), true],
        ["message_stats.publish_details.rate", "Incoming", (r) => rate(get(r, "message_stats.publish_details.rate")), true],
        ["message_stats.deliver_get_details.rate", "Delivered", (r) => rate(get(r, "message_stats.deliver_get_details.rate")), true],
        ["consumers", "Consumers", null, true], ["policy", "Policy"]],
      create: () => form("add-queue", "Add a queue", [["vhost", "Virtual host", "text", "/"], ["name", "Name", "text", ""],
        ["type", "Type", ["classic", "quorum", "stream"], "classic"], ["durable", "Durable", "checkbox", true],
        ["arguments", "Arguments (JSON object)", "text", ""]], "Add queue", async (v) => {
        const args = parseJson(v.arguments, "Arguments");
        if (v.type !== "classic") args["x-queue-type"] = v.type;
        await api("PUT", `/api/queues/${enc(v.vhost)}/${enc(v.name)}`, { durable: v.durable, auto_delete: false, arguments: args });
        toast("Queue added.");
        await state.refresh();
      }),
    },
    mqtt: {
      title: "MQTT sessions", path: "/api/mqtt/sessions", sort: "client_id",
      cols: [["client_id", "Client id", (r) => link(`#/mqtt/${enc(r.vhost)}/${enc(r.client_id)}`, r.client_id)], ["vhost", "Virtual host"],
        ["user", "User"], ["connected", "Connected", (r) => yes(r.connected)], ["clean_session", "Session", (r) => (r.clean_session ? "clean" : "persistent")],
        ["subscription_count", "Subscriptions", null, true], ["in_flight", "In flight", (r) => num(r.in_flight), true],
        ["messages", "Queued", (r) => num(r.messages), true], ["will.topic", "Will", (r) => (r.will ? r.will.topic : "")]],
    },
    consumers: {
      title: "Consumers", path: "/api/consumers", sort: "consumer_tag",
      cols: [["consumer_tag", "Consumer tag"], ["queue.name", "Queue", (r) => link(`#/queues/${enc(r.queue.vhost)}/${enc(r.queue.name)}`, r.queue.name)],
        ["queue.vhost", "Virtual host"], ["channel_details.name", "Channel"], ["ack_required", "Ack required", (r) => yes(r.ack_required)],
        ["prefetch_count", "Prefetch", null, true], ["active", "Active", (r) => yes(r.active)]],
    },
  };

  async function listPage(kind) {
    const spec = LISTS[kind];
    const vhost = Prefs.get("vhost");
    const path = vhost && VHOST_PATHS[kind] ? VHOST_PATHS[kind](vhost) : spec.path;
    const shown = () => spec.cols.filter(([key, label]) => !label || !Prefs.hidden(kind).includes(key));
    const list = pagedList(path, shown, { sort: spec.sort });
    page(vhost ? `${spec.title} in ${vhost}` : spec.title, columnChooser(kind, spec.cols, list.refresh), list.root,
      spec.create && isAdmin() ? spec.create() : null);
    return list.refresh;
  }

  // ------------------------------------------------------------------ operator's choices
  // Lists of one vhost, when one is picked in the header (RabbitMQ's per-vhost list paths).
  const VHOST_PATHS = {
    connections: (v) => `/api/vhosts/${enc(v)}/connections`, channels: (v) => `/api/vhosts/${enc(v)}/channels`,
    exchanges: (v) => `/api/exchanges/${enc(v)}`, queues: (v) => `/api/queues/${enc(v)}`, consumers: (v) => `/api/consumers/${enc(v)}`,
    mqtt: (v) => `/api/mqtt/sessions/${enc(v)}`,
  };

  // Checkboxes for a list's columns (the first, the name, always shows); remembered per list.
  function columnChooser(kind, cols, refresh) {
    const boxes = cols.slice(1).filter(([, label]) => label).map(([key, label]) => h("label", {},
      h("input", { type: "checkbox", "data-column": key, checked: !Prefs.hidden(kind).includes(key), onchange: (ev) => {
        const hidden = Prefs.hidden(kind).filter((k) => k !== key);
        if (!ev.target.checked) hidden.push(key);
        Prefs.setHidden(kind, hidden);
        refresh();
      } }), label));
    return h("details", { class: "columns", id: "columns" }, h("summary", {}, "Columns"), boxes);
  }

  // The header's selectors: chart range and refresh interval at once; the virtual host (every
  // list) once the first page is drawn, so listing the vhosts never delays it.
  function headerChoices() {
    const range = $("#range"), interval = $("#interval");
    range.replaceChildren(...Prefs.RANGES.map(([age, , label]) => h("option", { value: age, selected: age === Prefs.range()[0] }, label)));
    interval.replaceChildren(...Prefs.INTERVALS.map(([s, label]) => h("option", { value: s, selected: s === Prefs.get("interval") }, label)));
    range.onchange = () => { Prefs.set("range", Number(range.value)); if (state.refresh) state.refresh(); };
    interval.onchange = () => { Prefs.set("interval", Number(interval.value)); startTimer(); };
    showVhostLink();
  }

  function showVhostLink() {
    const v = Prefs.get("vhost");
    $("#vhost-link").hidden = !v;
    $("#vhost-link").href = `#/vhosts/${enc(v)}`;
  }

  async function vhostChoices() {
    const vhost = $("#vhost");
    let names = [];
    try { names = (await api("GET", "/api/vhosts?columns=name")).map((v) => v.name); } catch { names = []; }
    const picked = names.includes(Prefs.get("vhost")) ? Prefs.get("vhost") : "";
    vhost.replaceChildren(h("option", { value: "" }, "All"), ...names.map((n) => h("option", { value: n, selected: n === picked }, n)));
    vhost.onchange = () => { Prefs.set("vhost", vhost.value); showVhostLink(); route(); };
    if (picked !== Prefs.get("vhost")) { // the remembered vhost is gone (or no longer visible)
      Prefs.set("vhost", picked);
      showVhostLink();
      route();
    }
  }

  // ------------------------------------------------------------------ node, channel and vhost pages
  const DATA_SERIES = [["recv_oct", "received"], ["send_oct", "sent"]];
  const alarm = (on) => h("span", { class: on ? "bad" : "ok" }, on ? "ALARM" : "ok");

  async function nodePage(name) {
    const base = `/api/nodes/${enc(name)}`;
    const details = h("div", { id: "node-details" });
    const memory = h("div", { id: "node-memory" });
    const memChart = chart("Memory used (bytes)", [["mem_used", "memory"]]);
    const fdChart = chart("File descriptors and sockets", [["fd_used", "file descriptors"], ["sockets_used", "sockets"]]);
    page(`Node ${name}`, details, h("div", { class: "charts" }, memChart.root, fdChart.root), h("h2", {}, "Memory breakdown"), memory);
    return async () => {
      const n = await api("GET", ranged(`${base}?memory=true`));
      details.replaceChildren(kv([["Uptime", `${Math.round((n.uptime || 0) / 60000)} min`], ["Processors", num(n.processors)],
        ["Memory", `${bytes(n.mem_used)} of ${bytes(n.mem_limit)} (high watermark)`], ["Memory alarm", alarm(n.mem_alarm)],
        ["Disk free", `${bytes(n.disk_free)} (limit ${bytes(n.disk_free_limit)})`], ["Disk alarm", alarm(n.disk_free_alarm)],
        ["File descriptors", `${num(n.fd_used)} of ${num(n.fd_total)}`], ["Sockets", `${num(n.sockets_used)} of ${num(n.sockets_total)}`]]));
      memChart.set(Prefs.series(n, ["mem_used"], false));
      fdChart.set(Prefs.series(n, ["fd_used", "sockets_used"], false));
      const m = n.memory || {};
      const rows = Object.entries(m).filter(([k, v]) => k !== "total" && typeof v === "number").sort((a, b) => b[1] - a[1]);
      memory.replaceChildren(table([["0", "Held by"], ["1", "Bytes", (r) => bytes(r[1]), true]], rows),
        kv(Object.entries(m.total || {}).map(([k, v]) => [`Total (${k})`, bytes(v)])));
    };
  }

  async function channelPage(name) {
    const details = h("div", { id: "channel-details" });
    const consumers = h("div");
    const rates = chart("Message rates", CHANNEL_SERIES);
    page(`Channel ${name}`, details, rates.root, h("h2", {}, "Consumers"), consumers);
    return async () => {
      const c = await api("GET", ranged(`/api/channels/${enc(name)}`));
      rates.set(Prefs.series(c.message_stats, CHANNEL_SERIES.map(([k]) => k), true));
      const conn = c.connection_details.name;
      details.replaceChildren(kv([["Connection", link(`#/connections/${enc(conn)}`, conn)], ["Number", c.number], ["User", c.user],
        ["Virtual host", c.vhost], ["State", c.state], ["Mode", c.confirm ? "confirm" : c.transactional ? "transactional" : "plain"],
        ["Prefetch", `${num(c.prefetch_count)} per consumer, ${num(c.global_prefetch_count)} per channel`],
        ["Unacked", num(c.messages_unacknowledged)], ["Unconfirmed", num(c.messages_unconfirmed)],
        ["Uncommitted", `${num(c.messages_uncommitted)} messages, ${num(c.acks_uncommitted)} acks`]]));
      const cs = await api("GET", `/api/consumers/${enc(c.vhost)}`).catch(() => []);
      consumers.replaceChildren(table(LISTS.consumers.cols, cs.filter((x) => get(x, "channel_details.name") === name), { empty: "No consumers." }));
    };
  }

  // One MQTT session (GET /api/mqtt/sessions/{vhost}/{client id}): connected or away, its
  // subscriptions with their QoS, its will and its in-flight deliveries; the connection's page
  // while it is connected, and its subscription queues' pages.
  async function mqttSessionPage(vhost, clientId) {
    const details = h("div", { id: "mqtt-details" });
    const subs = h("div", { id: "mqtt-subscriptions" });
    const will = h("div", { id: "mqtt-will" });
    page(`MQTT session ${clientId}`, details, h("h2", {}, "Subscriptions"), subs, h("h2", {}, "Will"), will);
    return async () => {
      const s = await api("GET", `/api/mqtt/sessions/${enc(vhost)}/${enc(clientId)}`);
      const queues = ["qos0", "qos1"].map((q) => `mqtt-subscription-${clientId}${q}`);
      details.replaceChildren(kv([["Virtual host", s.vhost], ["User", s.user || "\u2014"],
        ["State", s.connected ? h("span", { class: "ok" }, "connected") : h("span", { class: "muted" }, "not connected")],
        ["Session", s.clean_session ? "clean (ends with its connection)" : "persistent"],
        ["Session expiry", s.session_expiry_interval == null ? "\u2014" : `${num(s.session_expiry_interval)} s`],
        ["Protocol level", s.protocol_level ?? "\u2014"], ["Client address", s.peer_host || "\u2014"],
        ["In flight", `${num(s.in_flight)}${s.in_flight_max ? ` of ${num(s.in_flight_max)}` : ""}`], ["Queued for it", num(s.messages)],
        ["Connection", s.connected ? link(`#/connections/${enc(s.client_id)}`, s.client_id) : "\u2014"],
        ["Queues", h("span", {}, queues.map((q) => [link(`#/queues/${enc(s.vhost)}/${enc(q)}`, q), " "]))]]));
      subs.replaceChildren(table([["filter", "Topic filter"], ["qos", "QoS", null, true], ["requested_qos", "Requested QoS", null, true],
        ["subscription_id", "Subscription id", (r) => r.subscription_id ?? ""]], s.subscriptions, { empty: "No subscriptions." }));
      will.replaceChildren(s.will ? kv([["Topic", s.will.topic], ["QoS", s.will.qos], ["Retain", yes(s.will.retain)],
        ["Payload", bytes(s.will.payload_bytes)], ["Delay", `${num(s.will.delay)} s`]]) : h("p", { class: "muted" }, "No will."));
    };
  }

  async function vhostPage(name) {
    const details = h("div", { id: "vhost-details" });
    const rateChart = chart("Message rates", RATE_SERIES);
    const lengthChart = chart("Queued messages", LENGTH_SERIES);
    page(`Virtual host ${name}`, details, h("div", { class: "charts" }, lengthChart.root, rateChart.root));
    return async () => {
      const v = await api("GET", ranged(`/api/vhosts/${enc(name)}`));
      details.replaceChildren(kv([["Description", v.description], ["Default queue type", v.default_queue_type],
        ["Messages", `${num(v.messages)} (${num(v.messages_ready)} ready, ${num(v.messages_unacknowledged)} unacked)`],
        ["Traffic", `${bytes(v.recv_oct)} received, ${bytes(v.send_oct)} sent`]]));
      rateChart.set(Prefs.series(v.message_stats, RATE_KEYS, true));
      lengthChart.set(Prefs.series(v, LENGTH_KEYS, false));
    };
  }

  async function connectionPage(name) {
    const details = h("div");
    const channels = h("div");
    const traffic = chart("Data rates (bytes/s)", DATA_SERIES);
    page(`Connection ${name}`, details, traffic.root, h("h2", {}, "Channels"), channels,
      h("h2", {}, "Close this connection"),
      confirmButton("Close connection", `Close connection ${name}?`, "Connection closed.",
        () => api("DELETE", `/api/connections/${enc(name)}`), () => { location.hash = "#/connections"; }));
    return async () => {
      const c = await api("GET", ranged(`/api/connections/${enc(name)}`));
      traffic.set(Prefs.series(c, DATA_SERIES.map(([k]) => k), true));
      details.replaceChildren(kv([["User", c.user], ["Virtual host", c.vhost], ["Client address", `${c.peer_host}:${c.peer_port}`],
        ["Protocol", c.protocol], ["Authentication", c.auth_mechanism], ["TLS", c.ssl ? `${c.ssl_protocol || "yes"} ${c.ssl_cipher || ""}` : "no"],
        ["Heartbeat", `${c.timeout} s`], ["Frame max", num(c.frame_max)], ["Client", `${get(c, "client_properties.product") || ""} ${get(c, "client_properties.version") || ""}`],
        ["Connected at", new Date(c.connected_at).toLocaleString()], ["State", c.state]]));
      const chs = await api("GET", `/api/connections/${enc(name)}/channels`);
      channels.replaceChildren(table(LISTS.channels.cols, chs));
    };
  }

  async function queuePage(vhost, name) {
    const base = `/api/queues/${enc(vhost)}/${enc(name)}`;
    const details = h("div");
    const rateChart = chart("Message rates", RATE_SERIES);
    const lengthChart = chart("Queued messages", LENGTH_SERIES);
    const consumers = h("div");
    const bindings = h("div");
    const got = h("div", { id: "got-messages" });
    const getForm = form("get", "Get messages", [
      ["ackmode", "Ack mode", ["ack_requeue_true", "ack_requeue_false", "reject_requeue_true", "reject_requeue_false"], "ack_requeue_true"],
      ["encoding", "Encoding", ["auto", "base64"], "auto"], ["count", "Messages", "number", "1"], ["truncate", "Truncate payload at (bytes)", "number", "50000"],
    ], "Get messages", async (v) => {
      const msgs = await api("POST", `${base}/get`, { count: Number(v.count), ackmode: v.ackmode, encoding: v.encoding, truncate: Number(v.truncate) });
      got.replaceChildren(...(msgs.length ? [] : [h("p", { class: "muted" }, "The queue is empty.")]), ...msgs.map((m, i) => h("div", { class: "message" },
        h("h2", {}, `Message ${i + 1}`),
        kv([["Exchange", m.exchange || "(default)"], ["Routing key", m.routing_key], ["Redelivered", yes(m.redelivered)],
          ["Properties", json(m.properties)], ["Payload", `${num(m.payload_bytes)} bytes, encoding ${m.payload_encoding}`]]),
        h("pre", { class: "payload" }, m.payload))));
      if (state.refresh) await state.refresh();
    });
    const actions = h("div", { class: "bar" },
      confirmButton("Purge", `Remove every ready message from ${name}?`, "Queue purged.", () => api("DELETE", `${base}/contents`)),
      confirmButton("Delete queue", `Delete queue ${name} and its messages?`, "Queue deleted.", () => api("DELETE", base), () => { location.hash = "#/queues"; }));
    // LavinMQ's queue actions: paused, a queue takes publishes and delivers nothing
    const stateButton = (label, action, what) => h("button", { type: "button", id: `queue-${action}`,
      onclick: () => act(what, () => api("PUT", `${base}/${action}`)) }, label);
    const lifecycle = h("div", { class: "bar" }, stateButton("Pause", "pause", "Queue paused."),
      stateButton("Resume", "resume", "Queue resumed."), stateButton("Restart", "restart", "Queue restarted."));
    const streamBox = h("div");
    page(`Queue ${name}`, h("p", { class: "muted" }, `Virtual host ${vhost}`), details, h("div", { class: "charts" }, lengthChart.root, rateChart.root),
      h("h2", {}, "Consumers"), consumers, h("h2", {}, "Bindings"), bindings, bindingForm(vhost, { destination: name }),
      getForm, got, streamBox, publishForm(vhost, "", name), h("h2", {}, "Pause, resume or restart"), lifecycle,
      h("h2", {}, "Purge or delete"), actions);
    let streamReady = false;
    return async () => {
      const q = await api("GET", ranged(base));
      details.replaceChildren(kv([["Type", q.type], ["State", h("span", { id: "queue-state" }, q.state)], ["Durable", yes(q.durable)], ["Auto-delete", yes(q.auto_delete)],
        ["Exclusive", yes(q.exclusive)], ["Arguments", json(q.arguments)], ["Policy", q.policy || ""], ["Operator policy", q.operator_policy || ""],
        ["Effective policy", json(q.effective_policy_definition)],
        ["Ready", h("span", { id: "queue-ready" }, num(q.messages_ready))], ["Unacked", num(q.messages_unacknowledged)],
        ["Total", num(q.messages)], ["Consumers", num(q.consumers)]]));
      rateChart.set(Prefs.series(q.message_stats, RATE_KEYS, true));
      lengthChart.set(Prefs.series(q, LENGTH_KEYS, false));
      const cs = await api("GET", `/api/consumers/${enc(vhost)}`).catch(() => []);
      consumers.replaceChildren(table(LISTS.consumers.cols, cs.filter((c) => c.queue.name === name), { empty: "No consumers." }));
      bindings.replaceChildren(table(BINDING_COLS, await api("GET", `${base}/bindings`)));
      if ((q.type === "stream" || get(q, "arguments.x-queue-type") === "stream") && !streamReady) {
        streamReady = true;
        const out = h("div");
        streamBox.replaceChildren(form("browse", "Browse the stream", [["from", "From", ["offset", "timestamp"], "offset"],
          ["value", "Offset (a number, first, last) or timestamp (ms or ISO date)", "text", "first"], ["count", "Messages", "number", "20"]],
        "Browse", async (v) => {
          const p = new URLSearchParams({ count: v.count });
          if (v.from === "offset") p.set("offset", v.value);
          else p.set("timestamp", /^\d+$/.test(v.value) ? v.value : String(Date.parse(v.value)));
          const r = await api("GET", `/api/streams/${enc(vhost)}/${enc(name)}/messages?${p}`);
          const msgs = r.messages || r.items || [];
          out.replaceChildren(table([["offset", "Offset", null, true], ["timestamp", "Time", (m) => (m.timestamp ? new Date(m.timestamp).toISOString() : "")],
            ["routing_key", "Routing key"], ["payload", "Payload", (m) => h("pre", {}, String(m.payload ?? ""))]], msgs, { empty: "No messages there." }));
        }), out);
      }
    };
  }

  async function exchangePage(vhost, name) {
    const real = name === "amq.default" ? "" : name;
    const base = `/api/exchanges/${enc(vhost)}/${enc(name)}`;
    const details = h("div");
    const rateChart = chart("Message rates", [["publish_in", "in/s"], ["publish_out", "out/s"]]);
    const source = h("div");
    const dest = h("div");
    const builtin = real === "" || real.startsWith("amq.");
    page(`Exchange ${real || "(AMQP default)"}`, h("p", { class: "muted" }, `Virtual host ${vhost}`), details, rateChart.root,
      h("h2", {}, "Bindings from this exchange"), source, real ? bindingForm(vhost, { source: real }) : null,
      h("h2", {}, "Bindings to this exchange"), dest, publishForm(vhost, name, ""),
      builtin ? null : h("div", {}, h("h2", {}, "Delete"), confirmButton("Delete exchange", `Delete exchange ${real}?`, "Exchange deleted.",
        () => api("DELETE", base), () => { location.hash = "#/exchanges"; })));
    return async () => {
      const x = await api("GET", ranged(base));
      details.replaceChildren(kv([["Type", x.type], ["Durable", yes(x.durable)], ["Auto-delete", yes(x.auto_delete)], ["Internal", yes(x.internal)],
        ["Arguments", json(x.arguments)], ["Policy", x.policy || ""]]));
      rateChart.set(Prefs.series(x.message_stats, ["publish_in", "publish_out"], true));
      if (!real) { source.replaceChildren(h("p", { class: "muted" }, "The default exchange routes to the queue named by the routing key.")); dest.replaceChildren(); return; }
      source.replaceChildren(table(BINDING_COLS, await api("GET", `${base}/bindings/source`)));
      dest.replaceChildren(table(BINDING_COLS, await api("GET", `${base}/bindings/destination`)));
    };
  }

  // ------------------------------------------------------------------ admin
  const ADMIN_TABS = [["users", "Users"], ["vhosts", "Virtual hosts"], ["permissions", "Permissions"], ["policies", "Policies"],
    ["operator-policies", "Operator policies"], ["limits", "Limits"], ["definitions", "Definitions"]];
  ADMIN_TABS.splice(-1, 0, ["federation", "Federation"]);  // upstreams and link status (broker/federation)

  function deleteButton(label, what, url) {
    return h("button", { type: "button", class: "danger", onclick: () => { if (window.confirm(`Delete ${label}?`)) act(what, () => api("DELETE", url)); } }, "Delete");
  }

  async function adminPage(tab) {
    tab = tab || "users";
    const tabs = h("div", { class: "bar", role: "tablist" }, ADMIN_TABS.map(([k, label]) =>
      h("a", { href: `#/admin/${k}`, role: "tab", "aria-selected": k === tab ? "true" : "false", class: k === tab ? "active" : null }, label)));
    const live = h("div");
    const parts = [];
    let refresh;
    if (tab === "users") {
      const list = pagedList("/api/users", [["name", "Name"], ["tags", "Tags", (u) => (u.tags || []).join(", ")],
        ["", "", (u) => deleteButton(`user ${u.name}`, "User deleted.", `/api/users/${enc(u.name)}`)]]);
      parts.push(list.root, form("add-user", "Add a user or set a password", [["name", "Name", "text", ""], ["password", "Password", "password", ""],
        ["tags", "Tags (comma separated: administrator, monitoring, management, policymaker)", "text", ""]], "Save user", async (v) => {
        await api("PUT", `/api/users/${enc(v.name)}`, { password: v.password, tags: v.tags });
        toast("User saved.");
        await state.refresh();
      }));
      refresh = list.refresh;
    } else if (tab === "vhosts") {
      const list = pagedList("/api/vhosts", [["name", "Name"], ["description", "Description"], ["default_queue_type", "Default queue type"],
        ["messages", "Messages", (v) => num(v.messages), true], ["", "", (v) => deleteButton(`virtual host ${v.name}`, "Virtual host deleted.", `/api/vhosts/${enc(v.name)}`)]]);
      parts.push(list.root, form("add-vhost", "Add a virtual host", [["name", "Name", "text", ""], ["description", "Description", "text", ""]], "Add virtual host", async (v) => {
        await api("PUT", `/api/vhosts/${enc(v.name)}`, { description: v.description });
        toast("Virtual host added.");
        await state.refresh();
      }));
      refresh = list.refresh;
    } else if (tab === "permissions") {
      parts.push(live, form("set-permission", "Set permissions", [["user", "User", "text", ""], ["vhost", "Virtual host", "text", "/"],
        ["configure", "Configure (regex)", "text", ".*"], ["write", "Write (regex)", "text", ".*"], ["read", "Read (regex)", "text", ".*"]], "Set permissions", async (v) => {
        await api("PUT", `/api/permissions/${enc(v.vhost)}/${enc(v.user)}`, { configure: v.configure, write: v.write, read: v.read });
        toast("Permissions set.");
        await state.refresh();
      }));
      refresh = async () => live.replaceChildren(table([["user", "User"], ["vhost", "Virtual host"], ["configure", "Configure"], ["write", "Write"], ["read", "Read"],
        ["", "", (p) => deleteButton(`permissions of ${p.user} on ${p.vhost}`, "Permissions removed.", `/api/permissions/${enc(p.vhost)}/${enc(p.user)}`)]],
      await api("GET", "/api/permissions")));
    } else if (tab === "policies" || tab === "operator-policies") {
      const list = pagedList(`/api/${tab}`, [["name", "Name"], ["vhost", "Virtual host"], ["pattern", "Pattern"], ["apply-to", "Applies to"],
        ["priority", "Priority", null, true], ["definition", "Definition", (p) => json(p.definition)],
        ["", "", (p) => deleteButton(`policy ${p.name}`, "Policy deleted.", `/api/${tab}/${enc(p.vhost)}/${enc(p.name)}`)]]);
      parts.push(list.root, form("add-policy", tab === "policies" ? "Add or update a policy" : "Add or update an operator policy",
        [["vhost", "Virtual host", "text", "/"], ["name", "Name", "text", ""], ["pattern", "Pattern (regex)", "text", ".*"],
          ["apply-to", "Apply to", ["queues", "exchanges", "all"], "queues"], ["priority", "Priority", "number", "0"],
          ["definition", "Definition (JSON, e.g. {\"max-length\": 1000})", "textarea", ""]], "Save policy", async (v) => {
          await api("PUT", `/api/${tab}/${enc(v.vhost)}/${enc(v.name)}`, { pattern: v.pattern, "apply-to": v["apply-to"], priority: Number(v.priority), definition: parseJson(v.definition, "Definition") });
          toast("Policy saved.");
          await state.refresh();
        }));
      refresh = list.refresh;
    } else if (tab === "limits") {
      parts.push(live, form("set-limit", "Set a virtual host limit", [["vhost", "Virtual host", "text", "/"],
        ["name", "Limit", ["max-connections", "max-queues"], "max-connections"], ["value", "Value (-1: no limit)", "number", ""]], "Set limit", async (v) => {
        await api("PUT", `/api/vhost-limits/${enc(v.vhost)}/${enc(v.name)}`, { value: parseValue(v.value) });
        toast("Limit set.");
        await state.refresh();
      }));
      refresh = async () => {
        const rows = (await api("GET", "/api/vhost-limits")).flatMap((l) => Object.entries(l.value || {}).map(([name, value]) => ({ vhost: l.vhost, name, value })));
        live.replaceChildren(table([["vhost", "Virtual host"], ["name", "Limit"], ["value", "Value", null, true],
          ["", "", (l) => deleteButton(`limit ${l.name} of ${l.vhost}`, "Limit removed.", `/api/vhost-limits/${enc(l.vhost)}/${enc(l.name)}`)]], rows, { empty: "No limits set." }));
      };
    } else if (tab === "federation") {
      const upstreams = pagedList("/api/parameters/federation-upstream", [["name", "Upstream"], ["vhost", "Virtual host"],
        ["uri", "URI", (p) => [].concat(p.value.uri).join(" ")], ["value", "Settings", (p) => json(Object.fromEntries(Object.entries(p.value).filter(([k]) => k !== "uri")))],
        ["", "", (p) => deleteButton(`upstream ${p.name}`, "Upstream deleted.", `/api/parameters/federation-upstream/${enc(p.vhost)}/${enc(p.name)}`)]]);
      parts.push(h("h2", {}, "Links"), live, h("h2", {}, "Upstreams"), upstreams.root,
        form("add-upstream", "Add or update an upstream (a policy with federation-upstream or federation-upstream-set applies it)",
          [["vhost", "Virtual host", "text", "/"], ["name", "Name", "text", ""], ["uri", "URI (amqp://user:password@host:port/vhost)", "text", ""],
            ["settings", "More settings (JSON, e.g. {\"max-hops\": 2, \"prefetch-count\": 100})", "textarea", ""]], "Save upstream", async (v) => {
            const more = v.settings.trim() ? parseJson(v.settings, "Settings") : {};
            await api("PUT", `/api/parameters/federation-upstream/${enc(v.vhost)}/${enc(v.name)}`, { value: { uri: v.uri, ...more } });
            toast("Upstream saved.");
            await state.refresh();
          }));
      refresh = async () => {
        await upstreams.refresh();
        live.replaceChildren(table([["vhost", "Virtual host"], ["type", "Type"], ["", "Resource", (l) => l.exchange || l.queue],
          ["upstream", "Upstream"], ["uri", "URI"], ["status", "Status"], ["error", "Error"], ["timestamp", "Since"]],
        await api("GET", "/api/federation-links"), { empty: "No federation links." }));
      };
    } else if (tab === "definitions") {
      const download = h("button", { type: "button", id: "export", onclick: async () => {
        const doc = await api("GET", "/api/definitions");
        const a = h("a", { href: URL.createObjectURL(new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" })), download: "skred-definitions.json" });
        document.body.append(a);
        a.click();
        a.remove();
      } }, "Download definitions");
      const file = h("input", { type: "file", id: "import-file", accept: "application/json,.json" });
      const result = h("p", { role: "status", id: "import-result" });
      const upload = h("button", { type: "button", class: "primary", id: "import", onclick: async () => {
        if (!file.files.length) { result.textContent = "Choose a file first."; return; }
        try {
          await api("POST", "/api/definitions", await file.files[0].text());
          result.textContent = "Definitions imported.";
        } catch (e) {
          result.textContent = `Import refused: ${e.message}`;
        }
      } }, "Upload definitions");
      parts.push(h("h2", {}, "Export"), download, h("h2", {}, "Import"), h("div", { class: "bar" }, h("label", { for: "import-file" }, "Definitions file"), file, upload), result);
      refresh = async () => {};
    }
    page("Admin", tabs, ...parts);
    return refresh;
  }

  // ------------------------------------------------------------------ shovels
  // The status of every shovel (GET /api/shovels), its controls, and a form that PUTs a shovel
  // parameter (docs/shovels.md); the API checks who may do what.
  async function shovelsPage() {
    const live = h("div");
    const control = (s, label, method, url, what) => h("button", { type: "button", onclick: () => act(what, () => api(method, url)) }, label);
    const controls = (s) => {
      const one = `${enc(s.vhost)}/${enc(s.name)}`;
      return h("span", { class: "bar" },
        control(s, "Restart", "DELETE", `/api/shovels/vhost/${one}/restart`, "Shovel restarted."),
        s.state === "paused" ? control(s, "Resume", "PUT", `/api/shovels/${one}/resume`, "Shovel resumed.")
          : control(s, "Pause", "PUT", `/api/shovels/${one}/pause`, "Shovel paused."),
        deleteButton(`shovel ${s.name}`, "Shovel deleted.", `/api/parameters/shovel/${one}`));
    };
    const cols = [["name", "Name"], ["vhost", "Virtual host"], ["state", "State", (s) => s.reason ? `${s.state}: ${s.reason}` : s.state],
      ["src_uri", "Source", (s) => `${s.src_uri} ${s.src_queue ?? s.src_exchange ?? ""}`],
      ["dest_uri", "Destination", (s) => `${s.dest_uri} ${s.dest_queue ?? s.dest_exchange ?? ""}`],
      ["messages_transferred", "Moved", (s) => num(s.messages_transferred), true],
      ["blocked_status", "Flow", (s) => s.blocked_reason || s.blocked_status], ["", "", controls]];
    const add = form("add-shovel", "Add or replace a shovel", [["vhost", "Virtual host", "text", "/"], ["name", "Name", "text", ""],
      ["src-uri", "Source URI (amqp:// is this broker)", "text", "amqp://"], ["src-queue", "Source queue", "text", ""],
      ["dest-uri", "Destination URI (amqp://, amqps://, http(s)://)", "text", "amqp://"], ["dest-queue", "Destination queue", "text", ""],
      ["ack-mode", "Acknowledgement mode", ["on-confirm", "on-publish", "no-ack"], "on-confirm"],
      ["src-prefetch-count", "Prefetch count", "number", "1000"], ["reconnect-delay", "Reconnect delay (s)", "number", "5"],
      ["more", "More parameters (JSON, e.g. {\"src-delete-after\": \"queue-length\"})", "textarea", ""]], "Save shovel", async (v) => {
      const value = { "src-uri": v["src-uri"], "dest-uri": v["dest-uri"], "ack-mode": v["ack-mode"],
        "src-prefetch-count": Number(v["src-prefetch-count"]), "reconnect-delay": Number(v["reconnect-delay"]), ...parseJson(v.more, "More parameters") };
      if (v["src-queue"]) value["src-queue"] = v["src-queue"];
      if (v["dest-queue"]) value["dest-queue"] = v["dest-queue"];
      await api("PUT", `/api/parameters/shovel/${enc(v.vhost)}/${enc(v.name)}`, { value });
      toast("Shovel saved.");
      await state.refresh();
    });
    page("Shovels", live, add);
    return async () => live.replaceChildren(table(cols, await api("GET", "/api/shovels"), { empty: "No shovels." }));
  }

  // ------------------------------------------------------------------ router
  const ROUTES = [
    [/^shovels$/, () => shovelsPage()],
    [/^overview$/, () => overviewPage()],
    [/^(connections|channels|exchanges|queues|consumers|mqtt)$/, (m) => listPage(m[1])],
    [/^mqtt\/([^/]+)\/(.+)$/, (m) => mqttSessionPage(decodeURIComponent(m[1]), decodeURIComponent(m[2]))],
    [/^connections\/(.+)$/, (m) => connectionPage(decodeURIComponent(m[1]))],
    [/^channels\/(.+)$/, (m) => channelPage(decodeURIComponent(m[1]))],
    [/^nodes\/(.+)$/, (m) => nodePage(decodeURIComponent(m[1]))],
    [/^vhosts\/(.+)$/, (m) => vhostPage(decodeURIComponent(m[1]))],
    [/^queues\/([^/]+)\/(.+)$/, (m) => queuePage(decodeURIComponent(m[1]), decodeURIComponent(m[2]))],
    [/^exchanges\/([^/]+)\/(.+)$/, (m) => exchangePage(decodeURIComponent(m[1]), decodeURIComponent(m[2]))],
    [/^admin(?:\/([a-z-]+))?$/, (m) => adminPage(m[1])],
  ];

  async function route() {
    if (!state.user) { showLogin(); return; }
    const path = (location.hash || "#/overview").replace(/^#\/?/, "");
    const my = ++state.page;
    state.refresh = null;
    for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", path.split("/")[0] === a.getAttribute("href").slice(2));
    const match = ROUTES.map(([re, fn]) => [path.match(re), fn]).find(([m]) => m);
    if (!match) { page("Not found", h("p", {}, "No such page. "), link("#/overview", "Go to the overview")); return; }
    try {
      const refresh = await match[1](match[0]);
      if (my !== state.page) return;
      state.refresh = async () => {
        try {
          await refresh();
        } catch (e) {
          if (my === state.page && e.status !== 401) toast(e.message);
        }
      };
      await state.refresh();
      startTimer();
    } catch (e) {
      page("Error", h("p", { class: "error" }, e.message));
    }
  }

  window.addEventListener("hashchange", route);
  window.addEventListener("DOMContentLoaded", async () => {
    $("#logout").addEventListener("click", () => logout());
    try {
      const settings = await (await fetch("/api/auth", { cache: "no-store" })).json();
      state.sso = settings.oauth_enabled ? settings : null;
    } catch { state.sso = null; }
    if (state.sso && new URLSearchParams(location.search).has("code")) {
      const failed = await ssoFinish();
      if (failed) showLogin(failed);
      return;
    }
    if (!state.auth) { showLogin(); return; }
    try {
      state.user = await api("GET", "/api/whoami");
      started();
    } catch {
      logout("Please log in.");
    }
  });
})();
