// The voice-tools console: the token stays in this tab (sessionStorage) and goes in the Authorization
// header of every request, to this origin only; nothing is put in a URL. No library, no build step.
"use strict";
(() => {
  const KEY = "voice-tools-console-token";
  const view = document.body.dataset.view;
  const ident = document.body.dataset.id;
  const $ = (id) => document.getElementById(id);
  let me = null;
  let liveAbort = null;
  let shown = false; // the view was set up once: signing in again reloads the page instead

  // -- small helpers ---------------------------------------------------------------------
  // Bidirectional controls (embeddings, overrides, isolates, marks) in text a relay sent are shown, never
  // applied: each is drawn as its code point, so "\u202etxt.exe" reads "[U+202E]txt.exe", not "exe.txt".
  const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
  const visible = (text) => String(text).replace(BIDI, (c) => `[U+${c.codePointAt(0).toString(16).toUpperCase()}]`);
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child instanceof Node ? child : visible(child));
    }
    return node;
  }
  const sleep = (ms) => new Promise((done) => setTimeout(done, ms));
  // times: UTC by default, this browser's zone on the list's switch; a column's header names its zone
  let localZone = false;
  const zoneName = () => (localZone ? Intl.DateTimeFormat().resolvedOptions().timeZone || "local time" : "UTC");
  function setZone(local) {
    localZone = local;
    for (const header of document.querySelectorAll("[data-zone]")) header.textContent = `(${zoneName()})`;
  }
  function clock(iso) { // "2026-12-01 21:13:27" in the zone shown
    if (!iso) return "";
    const at = new Date(iso);
    return (localZone ? new Date(at.getTime() - at.getTimezoneOffset() * 60e3) : at).toISOString()
      .replace("T", " ").slice(0, 19);
  }
  function span(ms) {
    const s = ms / 1000;
    if (s < 1) return `${Math.max(0, Math.round(ms))} ms`;
    if (s < 60) return `${s.toFixed(1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${Math.floor(s % 60)}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
    return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  }
  // from its recording to its end; an open call's so far, marked "…"
  const took = (call) => (call.completed_at ? span(Date.parse(call.completed_at) - Date.parse(call.created_at)) :
    `${span(Date.now() - Date.parse(call.created_at))}…`);
  const time = (iso) => (iso ? `${new Date(iso).toISOString().replace("T", " ").slice(0, 23)} UTC` : "");
  const statusBadge = (status) => el("span", {class: `status s-${String(status).toLowerCase()}`}, status);
  // a text written only when it changed (an equal text written again is still a layout and a paint)
  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }
  function problem(text) {
    const p = $("problem");
    p.textContent = visible(text || "");
    p.hidden = !text;
  }

  // -- the API, with the token ---------------------------------------------------------------
  const token = () => sessionStorage.getItem(KEY);
  async function api(path, options = {}) {
    const headers = {Authorization: `Bearer ${token()}`};
    let body;
    if (options.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(options.json);
    }
    const answer = await fetch(path, {method: options.method || "GET", headers, body, cache: "no-store",
      credentials: "omit", redirect: "error"});
    const data = await answer.json().catch(() => null);
    if (answer.status === 401) {
      signOut("The token was refused.");
    }
    if (!answer.ok) {
      const error = new Error((data && data.message) || answer.statusText);
      error.status = answer.status;
      throw error;
    }
    return data;
  }

  // -- signing in and out ------------------------------------------------------------------
  function showSignIn(message) {
    $("sign-in").hidden = false;
    $("sign-in-error").textContent = message || "";
    $("nav").hidden = true;
    $("sign-out").hidden = true;
    $("who").textContent = "";
    for (const section of document.querySelectorAll(".view")) section.hidden = true;
    $("token").focus();
  }
  function signOut(message) {
    sessionStorage.removeItem(KEY);
    me = null;
    if (liveAbort) liveAbort.abort();
    liveAbort = null;
    problem("");
    for (const body of document.querySelectorAll(".view tbody, #calls-rows")) body.replaceChildren();
    showSignIn(message);
  }
  async function start() {
    try {
      me = await api("/console/api/me");
    } catch (error) {
      if (token()) signOut(error.message);
      return;
    }
    $("sign-in").hidden = true;
    $("token").value = "";
    $("nav").hidden = false;
    $("nav-tools").hidden = !me.admin;
    $("sign-out").hidden = false;
    $("who").textContent = `Signed in as ${me.name}${me.admin ? " (admin)" : ""}`;
    if (shown) {
      location.reload();
      return;
    }
    shown = true;
    const section = $(`view-${view}`);
    if (section) section.hidden = false;
    ({calls: callsView, call: callView, session: sessionView, tools: toolsView}[view])();
  }

  // -- the live stream: Server-Sent Events read with fetch (an EventSource cannot send the token) ----
  function setLive(text) {
    const state = $("live-state");
    if (state) state.textContent = text;
  }
  async function live(onCalls, onReread) {
    while (token()) {
      const abort = new AbortController();
      liveAbort = abort;
      try {
        const answer = await fetch("/console/api/live", {headers: {Authorization: `Bearer ${token()}`},
          signal: abort.signal, cache: "no-store", credentials: "omit"});
        if (!answer.ok) throw new Error(`live list: ${answer.status}`);
        setLive("live");
        const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const {value, done} = await reader.read();
          if (done) break;
          buffer += value;
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            let kind = "", data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith("event: ")) kind = line.slice(7);
              else if (line.startsWith("data: ")) data += line.slice(6);
            }
            if (kind === "calls") onCalls(JSON.parse(data));
            else if (kind === "reread") onReread();
          }
        }
      } catch (error) {
        if (abort.signal.aborted) return;
      }
      if (liveAbort !== abort) return;
      setLive("reconnecting");
      await sleep(2000);
    }
  }

  // a read that runs at most once at a time, and once more if asked meanwhile
  function coalesced(read) {
    let running = null, again = false;
    const run = async () => {
      if (running) {
        again = true;
        return running;
      }
      running = (async () => {
        do {
          again = false;
          try {
            await read();
          } catch (error) {
            problem(error.message);
          }
        } while (again);
      })();
      await running;
      running = null;
    };
    return run;
  }

  // -- the calls -------------------------------------------------------------------------
  // Every call read is held as data (10,000 and more); only the rows on screen, and a few either
  // side, are in the document, in a space as tall as every row held. A change to a call off screen
  // costs its entry only; changes are drawn at the next frame after a quiet second, else with the
  // others of their second (a frame a second at most, the counts by status in the same frame), and a
  // drawn row is patched in place (never redrawn, so the keyboard's focus stays where it is).
  // The filters are the page's URL (a view is a link: bookmarked, shared, kept by back and forward).
  const SPARE_ROWS = 12; // drawn above and below the screen
  const AGES_EVERY_MS = 10000; // the open calls' durations on screen: seconds need no faster clock
  const LIVE_EVERY_MS = 1000; // a busy stream's changes are drawn at most once a second
  const NOTE_EVERY_MS = 1000; // a paused list's note of what arrived is written again at most this often
  const COUNTS_EVERY_MS = 2000; // the counts by status are read again at most this often, only after a change
  const PRESETS = {"15m": 15 * 60e3, "1h": 3600e3, "24h": 86400e3, "7d": 7 * 86400e3};
  const TEXT_FILTERS = ["tool", "session_id", "caller", "tool_call_id"];
  function callsView() {
    const table = $("calls");
    const space = $("calls-space"); // as tall as every row held
    const list = $("calls-rows"); // the rows drawn, moved down to where they belong
    let calls = []; // every call held, newest first
    let byId = new Map(); // tool_call_id -> call
    let drawn = new Map(); // tool_call_id -> {row, status, ended, duration, call}
    let rowPx = 29, measured = false, shownFrom = 0, height = -1, frame = 0;
    let drawnAt = -Infinity, liveTimer = 0, scrollShift = 0, countsAnswer = null;
    let filters = {}; // what the server is asked: statuses, the text filters, created_from / created_to
    let next = null;
    let opener = null;
    let paused = false, held_back = new Map(), rereadWhenResumed = false, arrived = 0;

    for (const name of me.tools || []) $("f-tool").append(el("option", {value: name}, name));

    // -- the URL <-> the form --------------------------------------------------------------
    function fromUrl() {
      const url = new URLSearchParams(location.search);
      const statuses = new Set((url.get("status") || "").split(",").filter(Boolean));
      for (const box of document.querySelectorAll("#f-statuses input")) box.checked = statuses.has(box.value);
      for (const name of TEXT_FILTERS) $(`f-${name === "session_id" ? "session" : name === "tool_call_id" ? "id" : name}`)
        .value = url.get(name) || "";
      $("f-tool").value = url.get("tool") || ""; // a tool no longer in the registry: "any"
      if ((url.get("tool") || "") !== $("f-tool").value) {
        $("f-tool").append(el("option", {value: url.get("tool")}, url.get("tool")));
        $("f-tool").value = url.get("tool");
      }
      const range = url.get("range") || (url.get("from") || url.get("to") ? "custom" : "");
      $("f-range").value = range in PRESETS || range === "custom" ? range : "";
      $("local-time").checked = url.get("tz") === "local";
      setZone($("local-time").checked);
      $("f-from").value = url.get("from") ? inputValue(url.get("from")) : "";
      $("f-to").value = url.get("to") ? inputValue(url.get("to")) : "";
      $("f-custom").hidden = $("f-range").value !== "custom";
    }
    function toUrl() { // the form as the page's query string
      const url = new URLSearchParams();
      const statuses = [...document.querySelectorAll("#f-statuses input:checked")].map((box) => box.value);
      if (statuses.length) url.set("status", statuses.join(","));
      for (const [name, id] of [["tool", "f-tool"], ["session_id", "f-session"], ["caller", "f-caller"],
        ["tool_call_id", "f-id"]]) {
        const value = $(id).value.trim();
        if (value) url.set(name, value);
      }
      const range = $("f-range").value;
      if (range in PRESETS) url.set("range", range);
      if (range === "custom") {
        if ($("f-from").value) url.set("from", isoOf($("f-from").value));
        if ($("f-to").value) url.set("to", isoOf($("f-to").value));
      }
      if ($("local-time").checked) url.set("tz", "local");
      const text = url.toString();
      return text ? `?${text}` : "";
    }
    // a datetime-local field's value is read in the zone shown (UTC, or this browser's)
    const isoOf = (value) => new Date(localZone ? value : `${value}Z`).toISOString();
    function inputValue(iso) {
      const at = new Date(iso);
      if (Number.isNaN(at.getTime())) return "";
      const shifted = localZone ? new Date(at.getTime() - at.getTimezoneOffset() * 60e3) : at;
      return shifted.toISOString().slice(0, 19);
    }
    function filtersOf() { // the server's filters, from the URL (a preset counts back from now)
      const url = new URLSearchParams(location.search);
      const found = {};
      if (url.get("status")) found.status = url.get("status");
      for (const name of TEXT_FILTERS) if (url.get(name)) found[name] = url.get(name);
      const range = url.get("range");
      if (range in PRESETS) found.created_from = new Date(Date.now() - PRESETS[range]).toISOString();
      else {
        if (url.get("from")) found.created_from = url.get("from");
        if (url.get("to")) found.created_to = url.get("to");
      }
      return found;
    }
    function matches(call) {
      const statuses = filters.status ? filters.status.split(",") : null;
      if (statuses && !statuses.includes(call.status)) return false;
      if (filters.tool && call.function_name !== filters.tool) return false;
      for (const name of ["session_id", "caller", "tool_call_id"]) if (filters[name] && call[name] !== filters[name]) return false;
      if (filters.created_from && Date.parse(call.created_at) < Date.parse(filters.created_from)) return false;
      if (filters.created_to && Date.parse(call.created_at) >= Date.parse(filters.created_to)) return false;
      return true;
    }

    const newer = (a, b) => a.created_at > b.created_at ||
      (a.created_at === b.created_at && a.tool_call_id > b.tool_call_id);
    function place(call) { // where ``call`` is, or goes, newest first (by halving)
      let low = 0, high = calls.length;
      while (low < high) {
        const middle = (low + high) >> 1;
        if (newer(calls[middle], call)) low = middle + 1;
        else high = middle;
      }
      return low;
    }
    function rowOf(call) {
      const cell = (...content) => el("span", {role: "cell"}, ...content);
      const status = cell(statusBadge(call.status));
      const ended = cell(clock(call.completed_at));
      const duration = cell(took(call));
      const row = el("div", {role: "row", class: "row", "data-id": call.tool_call_id},
        cell(el("a", {href: `/console/calls/${encodeURIComponent(call.tool_call_id)}`}, call.tool_call_id)),
        cell(call.function_name), status,
        cell(el("a", {href: `/console/sessions/${encodeURIComponent(call.session_id)}`}, call.session_id)),
        cell(call.caller || ""), cell(el("time", {datetime: call.created_at}, clock(call.created_at))), ended, duration);
      return {row, status, ended, duration, call};
    }
    function draw() {
      frame = 0;
      drawnAt = performance.now();
      clearTimeout(liveTimer);
      liveTimer = 0;
      const shift = scrollShift; // the rows put above the screen since the last draw, scrolled past below
      scrollShift = 0;
      const top = space.getBoundingClientRect().top - shift; // the one read, before any write
      const from = Math.max(0, Math.floor(-top / rowPx) - SPARE_ROWS);
      const to = Math.min(calls.length, Math.ceil((innerHeight - top) / rowPx) + SPARE_ROWS);
      const kept = new Map();
      const nodes = [];
      for (let i = from; i < to; i += 1) {
        const call = calls[i];
        let shown = drawn.get(call.tool_call_id);
        if (!shown) shown = rowOf(call);
        else if (shown.call !== call) {
          if (shown.call.status !== call.status) shown.status.replaceChildren(statusBadge(call.status));
          if (shown.call.completed_at !== call.completed_at) {
            shown.ended.textContent = clock(call.completed_at);
            shown.duration.textContent = took(call);
          }
          shown.call = call;
        }
        const index = String(i + 2); // the header is row 1
        if (shown.row.getAttribute("aria-rowindex") !== index) shown.row.setAttribute("aria-rowindex", index);
        kept.set(call.tool_call_id, shown);
        nodes.push(shown.row);
      }
      for (const [id, shown] of drawn) if (!kept.has(id)) shown.row.remove();
      drawn = kept;
      let at = list.firstChild; // in order, moving nothing that is already in place
      for (const node of nodes) {
        if (at === node) at = at.nextSibling;
        else list.insertBefore(node, at);
      }
      if (from !== shownFrom) {
        shownFrom = from;
        list.style.transform = `translateY(${from * rowPx}px)`; // CSSOM: allowed by the policy
      }
      if (calls.length * rowPx !== height) {
        height = calls.length * rowPx;
        space.style.height = `${height}px`;
        table.setAttribute("aria-rowcount", String(calls.length + 1));
        table.dataset.held = String(calls.length);
        $("calls-empty").hidden = calls.length > 0;
      }
      if (shift) scrollBy(0, shift); // scrolled down: the rows being read stay where they are
      if (countsAnswer) showCounts();
      if (!measured && list.firstElementChild) { // once: the style sheet's row height
        measured = true;
        const px = list.firstElementChild.getBoundingClientRect().height;
        if (px > 0 && Math.abs(px - rowPx) > 0.5) {
          rowPx = px;
          shownFrom = -1;
          height = -1;
          soon();
        }
      }
    }
    function soon() {
      if (!frame) frame = requestAnimationFrame(draw);
    }
    // a change from the stream: drawn at once after a quiet second, else with the others of its second
    // (each drawing of a new call on top repaints the screen's rows: a busy stream costs a frame a second)
    function later() {
      if (frame || liveTimer) return;
      const wait = drawnAt + LIVE_EVERY_MS - performance.now();
      if (wait <= 0) soon();
      else liveTimer = setTimeout(soon, wait);
    }
    function redrawAll() { // the zone changed: every drawn row's times
      for (const shown of drawn.values()) shown.row.remove();
      drawn = new Map();
      shownFrom = -1;
      soon();
    }
    function hold(page, more) {
      if (!more) {
        calls = [];
        byId = new Map();
      }
      for (const call of page.calls) {
        if (byId.has(call.tool_call_id)) continue;
        byId.set(call.tool_call_id, call);
        calls.push(call);
      }
      next = page.next;
      $("older").hidden = !next;
      soon();
    }
    function query(path, extra) {
      return `${path}?${new URLSearchParams({...filters, ...extra})}`;
    }
    const load = coalesced(async () => {
      if (paused) {
        rereadWhenResumed = true;
        return;
      }
      hold(await api(query("/console/api/calls", {limit: 50})), false);
      problem("");
      countsSoon(true);
    });

    // -- the counts by status, for the filters but the statuses ---------------------------------
    let countsTimer = 0, countsWanted = false, countsAt = 0;
    const readCounts = coalesced(async () => {
      countsAt = Date.now();
      const others = {...filters};
      delete others.status; // the counts are of every status, under the other filters
      countsAnswer = await api(`/console/api/counts?${new URLSearchParams(others)}`);
      later(); // written with the list's next drawing (one frame for both)
    });
    function showCounts() {
      const answer = countsAnswer;
      countsAnswer = null;
      for (const badge of document.querySelectorAll("#f-statuses .count")) {
        setText(badge, `(${answer.counts[badge.dataset.status] || 0}${answer.more ? "+" : ""})`);
      }
      setText($("counted"), answer.more ? `Counts by status: of the newest ${answer.counted} calls only ` +
        "(narrow the time range for exact counts)." : `${answer.counted} call${answer.counted === 1 ? "" : "s"} ` +
        "match the other filters.");
    }
    function countsSoon(now) {
      if (now) {
        clearTimeout(countsTimer);
        countsTimer = 0;
        countsWanted = false;
        readCounts();
        return;
      }
      countsWanted = true;
      if (countsTimer) return;
      countsTimer = setTimeout(() => {
        countsTimer = 0;
        if (countsWanted && !document.hidden) {
          countsWanted = false;
          readCounts();
        }
      }, Math.max(0, countsAt + COUNTS_EVERY_MS - Date.now()));
    }

    function changed(given) {
      if (paused) { // held back, newest state of each, until resumed
        for (const call of given) {
          if (!held_back.has(call.tool_call_id) && !byId.has(call.tool_call_id) && matches(call)) arrived += 1;
          held_back.set(call.tool_call_id, call);
        }
        noteSoon();
        return;
      }
      let any = false;
      for (const call of given) {
        const known = byId.get(call.tool_call_id);
        if (known) {
          if (known.status !== call.status || known.completed_at !== call.completed_at) {
            calls[place(known)] = call;
            byId.set(call.tool_call_id, call);
            any = true;
            if (drawn.has(call.tool_call_id)) later();
          }
          continue;
        }
        if (!matches(call)) continue;
        any = true;
        const at = place(call);
        if (at === calls.length && next) continue; // older than every call held: in a later page
        calls.splice(at, 0, call);
        byId.set(call.tool_call_id, call);
        if (at < shownFrom + SPARE_ROWS && space.getBoundingClientRect().top - scrollShift < 0) {
          scrollShift += rowPx; // scrolled down: scrolled past at the next draw
        }
        later();
      }
      if (any) countsSoon(false);
    }
    // while paused the note says what arrived, written at most once a second (a frame each time)
    let noteTimer = 0;
    function noteSoon() {
      if (!noteTimer) noteTimer = setTimeout(writeNote, NOTE_EVERY_MS);
    }
    function writeNote() {
      noteTimer = 0;
      if (!paused) return;
      setText($("paused-note"), `Paused: ${arrived} new call${arrived === 1 ? "" : "s"} and ` +
        `${held_back.size - arrived} other change${held_back.size - arrived === 1 ? "" : "s"} arrived meanwhile.`);
    }
    function pause(on) {
      paused = on;
      clearTimeout(noteTimer);
      noteTimer = 0;
      $("pause").setAttribute("aria-pressed", String(on));
      $("pause").textContent = on ? "Resume" : "Pause";
      if (on) {
        $("paused-note").textContent = "Paused: nothing arrived yet.";
        return;
      }
      const waiting = [...held_back.values()];
      held_back = new Map();
      arrived = 0;
      $("paused-note").textContent = "";
      if (rereadWhenResumed) {
        rereadWhenResumed = false;
        load();
      } else changed(waiting);
    }
    function apply() {
      filters = filtersOf();
      load();
    }
    $("filters").addEventListener("submit", (event) => {
      event.preventDefault();
      const search = toUrl();
      if (search !== location.search) history.pushState(null, "", `/console${search}`);
      apply();
    });
    $("filters").addEventListener("reset", () => setTimeout(() => {
      $("f-custom").hidden = true;
      const keep = $("local-time").checked ? "?tz=local" : "";
      if (keep !== location.search) history.pushState(null, "", `/console${keep}`);
      apply();
    }));
    $("f-range").addEventListener("change", () => {
      $("f-custom").hidden = $("f-range").value !== "custom";
    });
    $("local-time").addEventListener("change", () => {
      const from = $("f-from").value && isoOf($("f-from").value), to = $("f-to").value && isoOf($("f-to").value);
      setZone($("local-time").checked);
      $("f-from").value = from ? inputValue(from) : ""; // the same moments, shown in the other zone
      $("f-to").value = to ? inputValue(to) : "";
      const url = new URLSearchParams(location.search);
      if ($("local-time").checked) url.set("tz", "local");
      else url.delete("tz");
      history.replaceState(null, "", `/console${url.toString() ? `?${url}` : ""}`);
      redrawAll();
    });
    addEventListener("popstate", () => { // back and forward: the view of that URL
      fromUrl();
      redrawAll();
      apply();
    });
    $("pause").addEventListener("click", () => pause(!paused));
    // many calls at once: the filters' calls counted first (as of the newest), then acted on once that count
    // is confirmed, a batch a request until the last; the counts by outcome, each call's result (the first
    // SHOWN on the page: every one is in its call's history)
    const SHOWN = 500;
    let bulkAction = null, bulkChosen = null, bulkStop = false;
    const plural = (n, word) => `${n.toLocaleString("en")} ${word}${n === 1 ? "" : "s"}`;
    async function askBulk(action, button) {
      bulkAction = action;
      bulkChosen = await api(`/console/api/bulk/${action}?${new URLSearchParams(filters)}`);
      const {count, over, bound} = bulkChosen;
      const what = action === "cancel" ? "cancel" : "redeliver the failed callbacks of";
      $("bulk-title").textContent = action === "cancel" ? "Cancel the matching calls?" : "Redeliver the matching calls' callbacks?";
      $("bulk-what").textContent = over ? `More than ${plural(bound, "call")} match: at most ${bound.toLocaleString("en")} ` +
        "at once. Narrow the filters (a time range, a tool, a session)." : count ? `This will ${what} ` +
        `${plural(count, "call")} (those the filters choose${action === "cancel" ? " that are still open" :
          " with a failed delivery"}, recorded until now; a call recorded after this count is left).` :
        "No call matches: nothing to do.";
      $("bulk-reason-line").hidden = action !== "cancel" || over || !count;
      $("bulk-reason").value = "";
      $("bulk-error").textContent = "";
      $("bulk-progress").textContent = "";
      $("bulk-results").replaceChildren();
      $("bulk-confirm").hidden = over || !count;
      $("bulk-confirm").disabled = false;
      $("bulk-stop").hidden = true;
      $("bulk-confirm").textContent = action === "cancel" ? `Cancel ${plural(count, "call")}` :
        `Redeliver for ${plural(count, "call")}`;
      opener = button;
      $("bulk-dialog").showModal();
    }
    $("bulk-cancel").addEventListener("click", () => askBulk("cancel", $("bulk-cancel")).catch((e) => problem(e.message)));
    $("bulk-redeliver").addEventListener("click", () => askBulk("redeliver", $("bulk-redeliver")).catch((e) => problem(e.message)));
    $("bulk-back").addEventListener("click", () => {
      bulkStop = true;
      $("bulk-dialog").close();
      if (opener) opener.focus();
    });
    $("bulk-stop").addEventListener("click", () => {
      bulkStop = true;
    });
    function showProgress(done, counts, total, running) {
      const outcomes = Object.entries(counts).map(([outcome, n]) => `${outcome.replace(/_/g, " ")} ${n.toLocaleString("en")}`);
      $("bulk-progress").textContent = `${done.toLocaleString("en")} of ${plural(total, "call")} ` +
        `${running ? "so far" : "done"}${outcomes.length ? `: ${outcomes.join(", ")}` : ""}` +
        `${!running && done < total ? ` (${(total - done).toLocaleString("en")} no longer matched when their turn came)` : ""}.`;
    }
    $("bulk-confirm").addEventListener("click", async () => {
      $("bulk-confirm").disabled = true;
      $("bulk-stop").hidden = false;
      bulkStop = false;
      const reason = $("bulk-reason").value.trim();
      const {count, until} = bulkChosen;
      const counts = {};
      let after = null, done = 0, shown = 0;
      const list = $("bulk-results");
      try {
        do {
          const batch = await api(`/console/api/bulk/${bulkAction}`, {method: "POST", json: {filters, expected: count,
            until, ...(after ? {after} : {}), ...(bulkAction === "cancel" && reason ? {reason} : {})}});
          $("bulk-confirm").hidden = true;
          for (const [outcome, n] of Object.entries(batch.counts)) counts[outcome] = (counts[outcome] || 0) + n;
          done += batch.results.length;
          for (const r of batch.results.slice(0, Math.max(0, SHOWN - shown))) {
            list.append(el("li", {"data-id": r.tool_call_id},
              el("a", {href: `/console/calls/${encodeURIComponent(r.tool_call_id)}`}, r.tool_call_id), ": ",
              r.ok ? (r.status || `${plural(r.queued, "event")} queued`) : `refused (${r.outcome}): ${r.message}`));
          }
          shown = list.children.length;
          after = batch.next;
          showProgress(done, counts, count, Boolean(after));
        } while (after && !bulkStop);
      } catch (error) {
        $("bulk-error").textContent = error.message;
      }
      if (after && bulkStop) $("bulk-error").textContent = `Stopped: ${plural(done, "call")} acted on, the others left as they are.`;
      if (done > shown) list.append(el("li", {}, `… and ${plural(done - shown, "other call")} (counted above; each ` +
        "call's history says what was done)."));
      $("bulk-stop").hidden = true;
      $("bulk-back").focus();
    });
    $("older").addEventListener("click", async () => {
      if (!next) return;
      try {
        hold(await api(query("/console/api/calls", {limit: 200, ...next})), true);
      } catch (error) {
        problem(error.message);
      }
    });
    addEventListener("scroll", soon, {passive: true});
    addEventListener("resize", soon, {passive: true});
    setInterval(() => { // only the open calls drawn, and only a text that changed
      if (document.hidden) return;
      for (const shown of drawn.values()) {
        if (shown.call.completed_at) continue;
        const text = took(shown.call);
        if (shown.duration.textContent !== text) shown.duration.textContent = text;
      }
    }, AGES_EVERY_MS);
    fromUrl();
    filters = filtersOf();
    live(changed, load); // the stream's first frame says "read": the list is read once it listens
  }

  // -- one call ------------------------------------------------------------------------
  function callView() {
    const id = ident;
    const path = `/console/api/calls/${encodeURIComponent(id)}`;
    const load = coalesced(async () => {
      let shown;
      try {
        shown = await api(path);
      } catch (error) {
        if (error.status === 404) {
          $("view-call").hidden = true;
          problem(`No call ${id} that this token may see.`);
          if (liveAbort) liveAbort.abort();
          return;
        }
        throw error;
      }
      render(shown);
    });

    async function act(button, request) {
      button.disabled = true;
      try {
        await request();
        problem("");
      } catch (error) {
        problem(error.message);
      }
      await load();
    }
    // Proceed and Cancel each ask first, in a dialog: Proceed shows the checkpoint's own preview (what
    // the next step will send or book) and says whether that step acts; Cancel takes an optional reason.
    let following = null; // what Proceed does, as the last read of the call said it
    let opener = null;
    const PREVIEW_ORDER = ["to", "cc", "bcc", "subject", "body", "title", "start", "end", "timezone", "attendees"];
    function previewRows(preview) {
      const keys = Object.keys(preview || {});
      keys.sort((a, b) => ((PREVIEW_ORDER.indexOf(a) + 1 || 99) - (PREVIEW_ORDER.indexOf(b) + 1 || 99)) ||
        (a < b ? -1 : 1));
      const rows = [];
      for (const key of keys) {
        const value = preview[key];
        const text = Array.isArray(value) ? value.map((v) => (typeof v === "string" ? v : JSON.stringify(v))).join(", ")
          : typeof value === "string" ? value : JSON.stringify(value, null, 2);
        rows.push(el("dt", {}, key), el("dd", {"data-field": key},
          text.includes("\n") || text.length > 80 ? el("pre", {}, text) : text || "(none)"));
      }
      return rows.length ? rows : [el("dt", {}, "preview"), el("dd", {}, "(none recorded)")];
    }
    function openDialog(dialog, from) {
      opener = from;
      dialog.showModal();
    }
    function closeDialog(dialog) {
      dialog.close();
      if (opener && opener.isConnected) opener.focus();
      else if ($("action-proceed") || $("action-cancel")) ($("action-proceed") || $("action-cancel")).focus();
    }
    $("proceed-back").addEventListener("click", () => closeDialog($("proceed-dialog")));
    $("cancel-back").addEventListener("click", () => closeDialog($("cancel-dialog")));
    $("again-back").addEventListener("click", () => closeDialog($("again-dialog")));
    let unconfirmed = false;
    $("again-confirm").addEventListener("click", async () => {
      const button = $("again-confirm");
      if (unconfirmed && !$("again-ack").checked) {
        $("again-error").textContent = "Tick the acknowledgment first: this call's first run may have acted.";
        $("again-ack").focus();
        return;
      }
      button.disabled = true;
      let started;
      try {
        started = await api(`${path}/run-again`, {method: "POST",
          json: unconfirmed ? {acknowledge_may_have_acted: true} : {}});
      } catch (error) {
        $("again-error").textContent = error.message;
        button.disabled = false;
        return;
      }
      location.assign(`/console/calls/${encodeURIComponent(started.tool_call_id)}`); // the new call
    });
    function askAgain(button, record) {
      unconfirmed = record.outcome === "unconfirmed";
      $("again-ack").checked = false;
      $("again-ack-line").hidden = !unconfirmed;
      $("again-error").textContent = "";
      $("again-confirm").disabled = false;
      openDialog($("again-dialog"), button);
    }
    $("proceed-confirm").addEventListener("click", async () => {
      const button = $("proceed-confirm");
      button.disabled = true;
      try {
        await api(`${path}/proceed`, {method: "POST", json: {}});
        problem("");
      } catch (error) {
        problem(error.message);
      }
      button.disabled = false;
      closeDialog($("proceed-dialog"));
      await load();
    });
    $("cancel-confirm").addEventListener("click", async () => {
      const button = $("cancel-confirm");
      const reason = $("cancel-reason").value.trim();
      button.disabled = true;
      try {
        await api(`${path}/cancel`, {method: "POST", json: reason ? {reason} : {}});
      } catch (error) {
        $("cancel-error").textContent = error.message; // the dialog stays open: the reason can be changed
        button.disabled = false;
        return;
      }
      button.disabled = false;
      problem("");
      closeDialog($("cancel-dialog"));
      await load();
    });
    function askProceed(button) {
      const next = following || {};
      $("proceed-title").textContent = next.step ? `Proceed to ${next.step}?` : "Proceed?";
      $("proceed-what").textContent = next.message || "The call goes on from its checkpoint.";
      $("proceed-preview").replaceChildren(...previewRows(next.preview));
      $("proceed-warning").textContent = next.side_effect ? `${next.step} acts: once it begins, the call can no ` +
        "longer be cancelled." : "";
      $("proceed-confirm").textContent = next.step ? `Proceed: ${next.step}` : "Proceed";
      openDialog($("proceed-dialog"), button);
    }
    function askCancel(button) {
      $("cancel-reason").value = "";
      $("cancel-error").textContent = "";
      openDialog($("cancel-dialog"), button);
      $("cancel-reason").focus();
    }
    const acted = (entry) => (entry.by || entry.via ?
      el("span", {class: "acted"}, ` by ${entry.by || "?"}${entry.via ? ` via ${entry.via}` : ""}`) : null);

    function render(shownCall) {
      const {record, steps, events, attempts, counters, next, trace_url: traceUrl} = shownCall;
      following = next;
      $("call-trace").replaceChildren(...(traceUrl ? [el("a", {href: traceUrl, target: "_blank",
        rel: "noopener noreferrer"}, "Trace ↗")] : []));
      $("call-status").replaceChildren(statusBadge(record.status));
      $("call-summary").replaceChildren(`${record.function_name} · session `,
        el("a", {href: `/console/sessions/${encodeURIComponent(record.session_id)}`}, record.session_id),
        ` · caller ${record.caller || "none"} · step ${record.current_step || "none"} · progress ` +
        `${Math.round((record.progress || 0) * 100)}%`);
      const actions = $("actions");
      const offered = record.actions_available || [];
      const buttons = [];
      if (offered.includes("proceed")) {
        const proceed = el("button", {type: "button", id: "action-proceed", "aria-haspopup": "dialog"}, "Proceed…");
        proceed.addEventListener("click", () => askProceed(proceed));
        buttons.push(proceed);
      }
      if (offered.includes("cancel")) {
        const stop = el("button", {type: "button", id: "action-cancel", class: "danger", "aria-haspopup": "dialog"},
          "Cancel call…");
        stop.addEventListener("click", () => askCancel(stop));
        buttons.push(stop);
      }
      if ((shownCall.console_actions || []).includes("run_again")) {
        const again = el("button", {type: "button", id: "action-run-again", "aria-haspopup": "dialog"}, "Run again…");
        again.addEventListener("click", () => askAgain(again, record));
        buttons.push(again);
      }
      const links = [];
      for (const entry of record.status_history || []) {
        if (entry.again_of) links.push(["Runs again ", entry.again_of]);
        if (entry.run_again_as) links.push(["Run again as ", entry.run_again_as]);
      }
      actions.replaceChildren(...buttons, ...links.map(([text, other]) => el("span", {class: "linked"}, text,
        el("a", {href: `/console/calls/${encodeURIComponent(other)}`}, other))));
      $("call-parameters").textContent = visible(JSON.stringify(record.parameters, null, 2));
      const changes = record.parameters_history || [];
      $("call-changes").replaceChildren(...(changes.length ? changes.map((c) =>
        el("li", {}, `${time(c.at)}: ${c.field} ${JSON.stringify(c.old)} → ${JSON.stringify(c.new)}`)) :
        [el("li", {}, "none")]));
      $("call-timeline").replaceChildren(...(record.status_history || []).map((entry) =>
        el("li", {}, el("time", {datetime: entry.at}, time(entry.at)), " ", statusBadge(entry.status),
          entry.reason ? ` ${entry.reason}` : "", acted(entry))));
      $("call-links").tBodies[0].replaceChildren(...(attempts.length ? attempts.map((run) =>
        el("tr", {class: `run r-${run.outcome}`}, el("td", {}, run.step), el("td", {}, time(run.started_at)),
          el("td", {}, `${Math.round(run.took_ms)} ms`), el("td", {}, run.outcome), el("td", {}, run.reason || ""))) :
        [el("tr", {}, el("td", {colspan: 5}, "No run of a link recorded yet."))]));
      $("call-counters").textContent = `Link runs: ${counters.attempts} in all, ${counters.step_attempts} of the ` +
        `current step; claims of the side effect: ${counters.effect_attempts}; chain run again by the ` +
        `stuck-call sweep: ${counters.redrives}.`;
      // the result panel: each of outcome, result, spoken sentence and error only when it has something
      const ending = [["outcome", record.outcome], ["result", record.result ? JSON.stringify(record.result, null, 2) : ""],
        ["voice", record.voice_response], ["error", record.error_message]];
      for (const [name, value] of ending) {
        $(`call-${name}-label`).hidden = !value;
        $(name === "result" ? "call-result-cell" : `call-${name}`).hidden = !value;
        $(`call-${name}`).textContent = visible(value || "");
      }
      $("call-open").hidden = ending.some(([, value]) => value);
      $("call-ending").hidden = !$("call-open").hidden;
      $("call-steps").tBodies[0].replaceChildren(...(steps.length ? steps.map(({step, kind, output}) =>
        el("tr", {"data-step": step}, el("th", {scope: "row"}, step), el("td", {}, kind),
          el("td", {}, el("pre", {}, JSON.stringify(output, null, 2))))) :
        [el("tr", {}, el("td", {colspan: 3}, "No step has recorded an output yet."))]));
      $("call-events").tBodies[0].replaceChildren(...events.map((item) => {
        const attempts = el("ol", {class: "attempts"}, ...item.attempt_log.map((a) =>
          el("li", {}, `${a.response_code === null ? "no answer" : `HTTP ${a.response_code}`}` +
            `${a.took_ms !== undefined ? `, ${a.took_ms} ms` : ""}, ${time(a.at)}${a.error ? `: ${a.error}` : ""}`)));
        const cell = el("td", {});
        if (item.actions_available.includes("redeliver")) {
          const again = el("button", {type: "button", class: "redeliver", "data-event": item.event_id,
            "aria-label": `Redeliver event ${item.seq} (${item.event})`}, "Redeliver");
          again.addEventListener("click", () => act(again, async () => {
            await api(`${path}/events/${item.event_id}/redeliver`, {method: "POST"});
            setTimeout(load, 1500); // the attempt is made by a worker, and recorded a moment later
          }));
          cell.append(again);
        }
        return el("tr", {"data-event": item.event_id}, el("td", {}, item.seq),
          el("td", {}, item.event + (item.step ? ` (${item.step})` : "")),
          el("td", {class: `delivery d-${item.state}`}, item.url ? item.state : "no URL"),
          el("td", {}, attempts), el("td", {}, time(item.next_attempt_at)),
          el("td", {}, el("code", {}, item.event_id)), cell);
      }));
    }
    live((calls) => {
      if (calls.some((c) => c.tool_call_id === id)) load();
    }, load);
  }

  // -- a session, as the relay's context reads it --------------------------------------------
  function sessionView() {
    const tbody = $("session-calls").tBodies[0];
    const load = coalesced(async () => {
      const context = await api(`/voice-tools/context/${encodeURIComponent(ident)}?limit=100`);
      const calls = [...context.pending, ...context.recent];
      calls.sort((a, b) => (a.created_at < b.created_at ? -1 : 1));
      tbody.replaceChildren(...calls.map((call) => el("tr", {"data-id": call.tool_call_id},
        el("td", {}, el("a", {href: `/console/calls/${encodeURIComponent(call.tool_call_id)}`}, call.tool_call_id)),
        el("td", {}, call.function_name), el("td", {}, statusBadge(call.status)), el("td", {}, time(call.created_at)),
        el("td", {}, call.voice_response || ""))));
    });
    live((calls) => {
      if (calls.some((c) => c.session_id === ident)) load();
    }, load);
  }

  // -- the tools -----------------------------------------------------------------------
  const SVG = "http://www.w3.org/2000/svg";
  function svgNode(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function chart(tool) {
    // the last hour, a bar per minute, oldest on the left; failures in a second colour. Its scale: the
    // busiest minute's count at the top of the left axis, 0 at its foot, the hour's two ends below.
    const left = 40, plot = 180, top = 6, high = 36, width = left + plot + 4, height = top + high + 14;
    const most = Math.max(1, ...tool.per_minute);
    const svg = svgNode("svg", {viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
      "aria-label": `${tool.tool}: ${tool.calls_last_hour} calls in the last hour, ${tool.failed_last_hour} failed; ` +
        `the busiest minute had ${Math.max(0, ...tool.per_minute)}`});
    svg.append(svgNode("rect", {x: left, y: top + high - 1, width: plot, height: 1, class: "axis"}),
      svgNode("rect", {x: left - 1, y: top, width: 1, height: high, class: "axis"}),
      svgNode("text", {x: left - 3, y: top + 7, class: "tick", "text-anchor": "end"}, `${most}/min`),
      svgNode("text", {x: left - 3, y: top + high, class: "tick", "text-anchor": "end"}, "0"),
      svgNode("text", {x: left, y: height - 1, class: "tick"}, "60 min ago"),
      svgNode("text", {x: left + plot, y: height - 1, class: "tick", "text-anchor": "end"}, "now"));
    for (let ago = 0; ago < 60; ago += 1) {
      for (const [values, kind] of [[tool.per_minute, "bar"], [tool.failed_per_minute, "bar-failed"]]) {
        if (!values[ago]) continue;
        const h = Math.max(1, Math.round((values[ago] / most) * (high - 2)));
        svg.append(svgNode("rect", {x: left + (59 - ago) * 3, y: top + high - 1 - h, width: 2, height: h, class: kind}));
      }
    }
    return svg;
  }
  const runs = (n) => `${n} run${n === 1 ? "" : "s"}`;
  function toolsView() {
    const tbody = $("tools").tBodies[0];
    const load = coalesced(async () => {
      const {tools} = await api("/console/api/tools");
      tbody.replaceChildren(...tools.map((tool) => el("tr", {"data-tool": tool.tool},
        el("th", {scope: "row"}, tool.tool), el("td", {}, tool.queue_depth === null ? "?" : tool.queue_depth),
        el("td", {}, Object.entries(tool.open).map(([s, n]) => `${n} ${s}`).join(", ") || "0"),
        el("td", {}, tool.calls_per_minute), el("td", {}, tool.failed_last_hour),
        el("td", {}, tool.callbacks_failed),
        el("td", {}, el("ul", {class: "steps"}, ...tool.steps.map((step) =>
          el("li", {}, `${step.step}: p50 ${step.p50_ms} ms, p99 ${step.p99_ms} ms (${runs(step.runs)})`)))),
        el("td", {}, chart(tool)))));
    });
    $("tools-refresh").addEventListener("click", load);
    load();
    setInterval(() => {
      if (!document.hidden && token()) load();
    }, 30000);
  }

  // -- wiring --------------------------------------------------------------------------
  $("sign-in-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const given = $("token").value.trim();
    if (!given) return;
    sessionStorage.setItem(KEY, given);
    start();
  });
  $("sign-out").addEventListener("click", () => signOut("Signed out."));
  if (token()) start();
  else showSignIn();
})();
