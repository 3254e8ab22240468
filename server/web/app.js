"use strict";
// edgeinfer's web chat: one page over this server's OpenAI routes (/v1/models, streamed
// /v1/chat/completions). Chats live in this browser's localStorage; the API key in sessionStorage
// (localStorage when "remember" is ticked) and only ever in the Authorization header. Model text is
// put into the page as text nodes, never as HTML. Drafted-and-accepted tokens come from the stream's
// opt-in extension (stream_options.include_drafted: choices[0].edgeinfer.drafted, code-point spans).

const $ = (id) => document.getElementById(id);
const KEYS = { chats: "edgeinfer.chats", current: "edgeinfer.currentChat", settings: "edgeinfer.settings",
               apiKey: "edgeinfer.apiKey" };
const MAX_CHATS = 200;
const SPECULATION = { off: "off", lookup: "lookup", "lookup-fixed": { method: "lookup", adaptive: false, draft_max: 4 } };
const FINISH_WORDS = { stop: "done", length: "max tokens", cancelled: "stopped", tool_calls: "tool calls" };

const settings = Object.assign({ speculation: "", temperature: 0.7, maxTokens: 512, system: "", showDrafted: true,
                                 model: "" }, readJSON(localStorage, KEYS.settings, {}));
let chats = readJSON(localStorage, KEYS.chats, []).filter((c) => c && Array.isArray(c.messages));
let current = null;     // the open chat
let streaming = null;   // the reply being received: {controller, chat, reply, body, tokens, firstAt, model}

function readJSON(storage, key, fallback) {
  try {
    const value = JSON.parse(storage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(KEYS.chats, JSON.stringify(chats.slice(0, MAX_CHATS)));
    localStorage.setItem(KEYS.settings, JSON.stringify(settings));
    if (current) localStorage.setItem(KEYS.current, current.id);
  } catch (e) {
    showError(`Could not keep the chats in this browser's storage (${e.name}): delete some chats.`);
  }
}

// -- the API key and requests ------------------------------------------------------------------

function apiKey() {
  return sessionStorage.getItem(KEYS.apiKey) || localStorage.getItem(KEYS.apiKey) || "";
}

function setApiKey(key, remember) {
  sessionStorage.removeItem(KEYS.apiKey);
  localStorage.removeItem(KEYS.apiKey);
  if (key) (remember ? localStorage : sessionStorage).setItem(KEYS.apiKey, key);
}

function requestHeaders(json) {
  const headers = {};
  if (json) headers["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

async function apiError(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || JSON.stringify(body);
  } catch { /* not JSON: keep the status text */ }
  const error = new Error(`${response.status}: ${message}`);
  error.status = response.status;
  return error;
}

function showError(text) {
  $("error").textContent = text || "";
  $("error").hidden = !text;
}

function askForKey(message) {
  showError(message);
  const dialog = $("key-dialog");
  $("key-input").value = "";
  $("key-remember").checked = Boolean(localStorage.getItem(KEYS.apiKey));
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

// -- models ------------------------------------------------------------------------------------

async function loadModels() {
  let body;
  try {
    const response = await fetch("/v1/models", { headers: requestHeaders(false), cache: "no-store" });
    if (!response.ok) throw await apiError(response);
    body = await response.json();
  } catch (e) {
    if (e.status === 401) askForKey(`This server needs an API key (${e.message}).`);
    else showError(`Could not list the models: ${e.message}`);
    return;
  }
  const select = $("model");
  select.replaceChildren();
  for (const m of body.data || []) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.edgeinfer && m.edgeinfer.loaded ? `${m.id} (loaded)` : m.id;
    option.dataset.loaded = m.edgeinfer && m.edgeinfer.loaded ? "1" : "";
    select.append(option);
  }
  const ids = [...select.options].map((o) => o.value);
  const loaded = [...select.options].find((o) => o.dataset.loaded);
  const wanted = [current && current.model, settings.model].find((id) => id && ids.includes(id));
  select.value = wanted || (loaded ? loaded.value : ids[0] || "");
  if (current && !current.model) current.model = select.value;
  showError("");
}

// -- chats -------------------------------------------------------------------------------------

function newChat() {
  const chat = { id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`, title: "New chat",
                 model: $("model").value || settings.model, messages: [], created: Date.now() };
  chats.unshift(chat);
  openChat(chat);
  save();
}

function openChat(chat) {
  current = chat;
  if (chat.model && [...$("model").options].some((o) => o.value === chat.model)) $("model").value = chat.model;
  renderChats();
  renderMessages();
  const last = [...chat.messages].reverse().find((m) => m.role === "assistant" && m.stats);
  $("stats").textContent = last ? statsLine(last.stats, last.model) : "ready";
  save();
}

function renderChats() {
  const list = $("chats");
  list.replaceChildren();
  for (const chat of chats) {
    const item = document.createElement("li");
    item.textContent = chat.title;
    item.title = chat.title;
    item.dataset.id = chat.id;
    if (chat === current) item.className = "current";
    item.addEventListener("click", () => { if (!streaming) openChat(chat); });
    list.append(item);
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...current.messages.map(messageElement));
  box.scrollTop = box.scrollHeight;
}

function messageElement(message) {
  const el = document.createElement("div");
  el.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  appendText(body, message.content, message.drafted || []);
  const note = document.createElement("div");
  note.className = "note";
  note.textContent = message.note || "";
  el.append(role, body, note);
  return el;
}

/** Text into `body`: plain text nodes, and the drafted spans ([start, end) in code points) as spans. */
function appendText(body, text, spans) {
  const chars = Array.from(text);
  let pos = 0;
  for (const [start, end] of spans) {
    if (start > pos) body.append(chars.slice(pos, start).join(""));
    const span = document.createElement("span");
    span.className = "drafted";
    span.textContent = chars.slice(start, end).join("");
    body.append(span);
    pos = end;
  }
  if (pos < chars.length) body.append(chars.slice(pos).join(""));
}

// -- the stats line (as the terminal UI's) ------------------------------------------------------

function seconds(s) {
  if (s >= 1) return `${s.toFixed(2)} s`;
  if (s >= 0.01) return `${Math.round(s * 1000)} ms`;
  return `${(s * 1000).toFixed(1)} ms`;
}

function statsLine(stats, model) {
  const parts = [`${stats.generated_tokens} tokens`, `${(stats.decode_tok_s || 0).toFixed(1)} tok/s`];
  const spec = stats.speculation;
  if (spec && spec.method !== "off") {
    parts.push(spec.drafted ? `${spec.method} ${Math.round(spec.acceptance_rate * 100)}% accepted, mean `
      + `${(spec.mean_accepted_len || 0).toFixed(1)}` : spec.method);
  }
  if (stats.ttft_s) parts.push(`ttft ${seconds(stats.ttft_s)}`);
  if (stats.finish_reason) parts.push(FINISH_WORDS[stats.finish_reason] || stats.finish_reason);
  parts.push(model);
  return parts.join(" · ");
}

function liveLine() {
  const s = streaming;
  const rate = s.tokens > 1 ? (s.tokens - 1) / ((performance.now() - s.firstAt) / 1000) : 0;
  const drafted = s.draftedTokens ? ` · ${s.draftedTokens} drafted tokens accepted` : "";
  return `${s.tokens} tokens · ${rate.toFixed(1)} tok/s${drafted} · ${s.model}`;
}

// -- sending and streaming ----------------------------------------------------------------------

function requestBody(chat, model) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of chat.messages) messages.push({ role: m.role, content: m.content });
  const body = { model, messages, stream: true, stream_options: { include_usage: true, include_drafted: true },
                 temperature: Number(settings.temperature), max_tokens: Number(settings.maxTokens) };
  if (SPECULATION[settings.speculation]) body.speculation = SPECULATION[settings.speculation];
  return body;
}

/** Server-sent events of a fetch response: each `data:` object to `onData`, until [DONE]. */
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;  // a keep-alive comment
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

function onChunk(data) {
  if (data.error) throw Object.assign(new Error(data.error.message || "server error"), { status: 500 });
  const s = streaming;
  const choice = (data.choices || [])[0];
  const text = choice && choice.delta && choice.delta.content;
  if (text) {
    const ext = choice.edgeinfer || { tokens: 1, drafted_tokens: 0, drafted: [] };
    const base = Array.from(s.reply.content).length;
    appendText(s.body, text, ext.drafted);
    s.reply.content += text;
    for (const [a, b] of ext.drafted) s.reply.drafted.push([base + a, base + b]);
    if (!s.tokens) s.firstAt = performance.now();
    s.tokens += ext.tokens;
    s.draftedTokens += ext.drafted_tokens;
    $("stats").textContent = liveLine();
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }
  if (data.edgeinfer) s.reply.stats = { ...data.edgeinfer, finish_reason: choice && choice.finish_reason };
}

async function send() {
  const text = $("prompt").value.trim();
  const model = $("model").value;
  if (!text || streaming) return;
  if (!model) {
    showError("No model to send to: the model list is empty (is the API key right?).");
    return;
  }
  showError("");
  const chat = current;
  chat.model = model;
  if (!chat.messages.length) chat.title = text.replace(/\s+/g, " ").slice(0, 40);
  chat.messages.push({ role: "user", content: text });
  const body = requestBody(chat, model);
  const reply = { role: "assistant", content: "", drafted: [], model };
  chat.messages.push(reply);
  $("prompt").value = "";
  renderChats();
  renderMessages();
  const controller = new AbortController();
  streaming = { controller, chat, reply, model, body: $("messages").lastChild.querySelector(".body"),
                tokens: 0, draftedTokens: 0, firstAt: 0 };
  setBusy(true);
  $("stats").textContent = `${model} · generating…`;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: requestHeaders(true),
                                                            body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) throw await apiError(response);
    await readEvents(response, onChunk);
    $("stats").textContent = reply.stats ? statsLine(reply.stats, model) : `${liveLine()} · done`;
  } catch (e) {
    if (e.name === "AbortError") {
      reply.note = "(stopped)";
      $("stats").textContent = `${liveLine()} · stopped`;
    } else {
      reply.note = `(error: ${e.message})`;
      $("stats").textContent = `error: ${e.message}`;
      if (e.status === 401) askForKey(`The server refused the API key (${e.message}).`);
      else showError(e.message);
    }
    if (!reply.content) chat.messages.pop();  // nothing came: nothing is kept
  } finally {
    streaming = null;
    setBusy(false);
    if (chat === current) renderMessages();
    save();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("model").disabled = busy;
  $("new-chat").disabled = busy;
  $("delete-chat").disabled = busy;
}

// -- wiring ------------------------------------------------------------------------------------

function applySettings() {
  $("speculation").value = settings.speculation;
  $("temperature").value = settings.temperature;
  $("max-tokens").value = settings.maxTokens;
  $("system").value = settings.system;
  $("show-drafted").checked = settings.showDrafted;
  document.body.classList.toggle("show-drafted", settings.showDrafted);
}

function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (streaming) streaming.controller.abort(); });
  $("new-chat").addEventListener("click", () => { newChat(); $("prompt").focus(); });
  $("delete-chat").addEventListener("click", () => {
    if (!current || !window.confirm(`Delete the chat "${current.title}"?`)) return;
    chats = chats.filter((c) => c !== current);
    if (chats.length) openChat(chats[0]); else newChat();
    save();
  });
  $("model").addEventListener("change", () => {
    settings.model = $("model").value;
    if (current) current.model = settings.model;
    save();
  });
  for (const [id, key] of [["speculation", "speculation"], ["temperature", "temperature"], ["max-tokens", "maxTokens"],
                           ["system", "system"]]) {
    $(id).addEventListener("change", () => { settings[key] = $(id).value; save(); });
  }
  $("show-drafted").addEventListener("change", () => {
    settings.showDrafted = $("show-drafted").checked;
    document.body.classList.toggle("show-drafted", settings.showDrafted);
    save();
  });
  $("change-key").addEventListener("click", () => askForKey(""));
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("key-form").addEventListener("submit", () => {
    setApiKey($("key-input").value.trim(), $("key-remember").checked);
    loadModels();
  });
  window.addEventListener("pagehide", save);
}

async function start() {
  applySettings();
  wire();
  await loadModels();
  const saved = chats.find((c) => c.id === localStorage.getItem(KEYS.current));
  if (saved || chats.length) openChat(saved || chats[0]); else newChat();
  $("prompt").focus();
}

start();
