// Skred management UI: the user's choices, remembered in localStorage, and the history ranges.
//
// How it works: app.js reads and writes preferences only through SkredPrefs (one JSON object
// under one key, so a bad or old value never breaks the page: unknown keys are ignored, a
// value that does not parse falls back to the default). A range is RabbitMQ's pair of age and
// increment in seconds; rangeQuery() asks the API for every kind of samples over it (lengths,
// message rates, byte rates, node gauges), and series() turns an answer's *_details samples
// (newest first, counters or gauges) into chart points, oldest first, as values or per-second rates.
"use strict";
window.SkredPrefs = (() => {
  const KEY = "skred.prefs";
  const RANGES = [[60, 5, "Last minute"], [600, 5, "Last 10 minutes"], [3600, 60, "Last hour"],
    [28800, 600, "Last 8 hours"], [86400, 1800, "Last day"]];
  const INTERVALS = [[5, "5 s"], [10, "10 s"], [30, "30 s"], [60, "1 min"], [0, "never"]];
  const DEFAULTS = { range: 600, interval: 5, vhost: "", hidden: {} };

  function load() {
    try {
      const v = JSON.parse(localStorage.getItem(KEY) || "{}");
      return v && typeof v === "object" ? v : {};
    } catch { return {}; }
  }
  function get(name) {
    const v = load()[name];
    return v === undefined || typeof v !== typeof DEFAULTS[name] ? DEFAULTS[name] : v;
  }
  function set(name, value) {
    const all = load();
    all[name] = value;
    localStorage.setItem(KEY, JSON.stringify(all));
  }
  function range() {
    return RANGES.find(([age]) => age === get("range")) || RANGES[1];
  }
  function rangeQuery() {
    const [age, incr] = range();
    return ["lengths", "msg_rates", "data_rates", "node_stats"].map((r) => `${r}_age=${age}&${r}_incr=${incr}`).join("&");
  }
  // Columns the user hid on a list page (kind: "queues", ...); keys as the page's columns name them.
  function hidden(kind) {
    const h = get("hidden")[kind];
    return Array.isArray(h) ? h : [];
  }
  function setHidden(kind, keys) {
    const all = get("hidden");
    all[kind] = keys;
    set("hidden", all);
  }
  // obj: the object holding "<key>_details"; keys: the series' keys. -> [[ms, {key: value}], ...]
  // A key without samples (a counter this object lacks) is left out of the points.
  function series(obj, allKeys, counter) {
    const keys = allKeys.filter((k) => (((obj || {})[`${k}_details`] || {}).samples || []).length);
    if (!keys.length) return [];
    const lists = keys.map((k) => obj[`${k}_details`].samples);
    const n = Math.min(...lists.map((l) => l.length));
    const out = [];
    for (let i = n - 1; i >= 0; i--) { // oldest first
      const t = lists[0][i].timestamp;
      const values = {};
      keys.forEach((k, j) => {
        const s = lists[j];
        if (!counter) values[k] = s[i].sample;
        else if (i + 1 < s.length) values[k] = Math.max(0, (s[i].sample - s[i + 1].sample) / Math.max(1e-3, (s[i].timestamp - s[i + 1].timestamp) / 1000));
      });
      if (!counter || i + 1 < n) out.push([t, values]);
    }
    return out;
  }
  return { RANGES, INTERVALS, get, set, range, rangeQuery, hidden, setHidden, series };
})();
