// The playground: a chat over this server's own /v1 API. No framework, no build step.
// Safety rule of this file: text from the model or the server is only ever written with
// textContent (never innerHTML), so an answer holding markup is shown as characters.
"use strict";

const KEY_STORAGE = "flashserve.apiKey"; // sessionStorage: gone when the tab closes
const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), log: $("log"), composer: $("composer"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"), clear: $("clear"), model: $("model"), apiKey: $("api-key"),
  thinking: $("thinking"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), system: $("system"), jsonMode: $("json-mode"),
  jsonSchema: $("json-schema"), tools: $("tools"), attach: $("attach"), files: $("image-files"),
  attachments: $("attachments"), attachHint: $("attach-hint"),
};

// Images go as OpenAI image_url parts with data: URLs, and only to a model whose
// /v1/models card lists "image" in its input_modalities.
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"]; // what the server decodes
const MAX_IMAGE_BYTES = 20 * 1024 * 1024; // the server's default limit per image
const imageModels = new Set();
const pending = []; // images for the next message, in order: {name, url}; url null while read

// The conversation as the API sees it, and the request in flight (if any).
const messages = [];
let inFlight = null; // {controller, discard}: discard when "New chat" ends it

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text, isError) {
  ui.status.textContent = text;
  ui.status.classList.toggle("error", Boolean(isError));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// What a failed response means to the person at the page.
function explain(status, body) {
  const message = body && body.error && body.error.message;
  if (status === 401) {
    const given = ui.apiKey.value.trim() ? "did not accept this API key" : "needs an API key";
    return `401: the server ${given}. Type one it was started with (--api-key or ` +
      `FLASHSERVE_API_KEYS) into "API key".`;
  }
  return `${status}: ${message || "the request failed"}`;
}

async function readError(response) {
  try { return explain(response.status, await response.json()); }
  catch { return explain(response.status, null); }
}

async function loadModels() {
  let response;
  try { response = await fetch("/v1/models", { headers: headers() }); }
  catch (err) { setStatus("Cannot reach the server: " + err.message, true); return; }
  if (!response.ok) { setStatus(await readError(response), true); return; }
  const previous = ui.model.value;
  const list = (await response.json()).data || [];
  ui.model.replaceChildren(...list.map((m) => el("option", "", m.id)));
  for (const option of ui.model.options) option.value = option.textContent;
  if (list.some((m) => m.id === previous)) ui.model.value = previous;
  imageModels.clear();
  for (const m of list) if ((m.input_modalities || []).includes("image")) imageModels.add(m.id);
  showAttach();
  setStatus(`${list.length} model names from /v1/models.`);
}

// ---------------------------------------------------------------- rendering

function addBlock(role, title) {
  const block = el("article", "msg " + role);
  block.append(el("h3", "who", title));
  ui.log.append(block);
  block.scrollIntoView({ block: "end" });
  return block;
}

function thumbnail(image) {
  const img = el("img", "thumb");
  img.src = image.url; // a data: URL (the policy's img-src allows data:)
  img.alt = image.name;
  return img;
}

function addUser(text, images) {
  const block = addBlock("user", "You");
  if (text) block.append(el("div", "text", text));
  if (images.length) block.append(el("div", "thumbs"));
  for (const image of images) block.lastChild.append(thumbnail(image));
}

// ---------------------------------------------------------------- images

function showAttach() {
  const on = imageModels.has(ui.model.value);
  ui.attach.hidden = ui.attachHint.hidden = !on;
  if (!on) { pending.length = 0; showPending(); }
}

function showPending() {
  ui.attachments.replaceChildren(...pending.filter((p) => p.url).map((image) => {
    const item = el("figure", "attachment");
    const remove = el("button", "", "\u00d7");
    remove.type = "button";
    remove.setAttribute("aria-label", "Remove " + image.name);
    remove.addEventListener("click", () => {
      pending.splice(pending.indexOf(image), 1);
      showPending();
      ui.prompt.focus();
    });
    item.append(thumbnail(image), remove);
    return item;
  }));
}

const mib = (n) => (n / 1048576).toFixed(1) + " MiB";

// Files picked, pasted or dropped: each checked here (type, size), then read as a data: URL.
function addImages(files) {
  if (!files.length) return;
  if (!imageModels.has(ui.model.value)) {
    setStatus(`${ui.model.value || "This model"} does not take images.`, true);
    return;
  }
  for (const file of files) {
    const name = file.name || "pasted image";
    if (!IMAGE_TYPES.includes(file.type)) {
      setStatus(`${name}: not a PNG, JPEG, WebP or GIF image.`, true);
    } else if (file.size > MAX_IMAGE_BYTES) {
      setStatus(`${name} is ${mib(file.size)}, over the server's limit of ` +
        `${mib(MAX_IMAGE_BYTES)} per image.`, true);
    } else {
      const image = { name, url: null };
      pending.push(image); // its place now: images go in the order they were added
      const reader = new FileReader();
      reader.onload = () => { image.url = reader.result; showPending(); };
      reader.onerror = () => {
        pending.splice(pending.indexOf(image), 1);
        setStatus(`${name}: cannot be read.`, true);
      };
      reader.readAsDataURL(file);
    }
  }
}

function addToolResult(id, text) {
  addBlock("tool", `Tool result (${id})`).append(el("div", "text", text));
}

// One assistant answer, filled in as its chunks arrive.
function answerView() {
  const block = addBlock("assistant", "Assistant");
  const view = { block, reasoning: null, reasoningText: null, content: null, calls: [] };
  view.content = el("div", "text content");
  block.append(view.content);
  return view;
}

function appendReasoning(view, text) {
  if (!view.reasoning) {
    view.reasoning = el("details", "reasoning live");
    view.reasoning.open = true; // open while it streams; the reader may fold it
    view.reasoning.append(el("summary", "", "Reasoning"));
    view.reasoningText = el("div", "text");
    view.reasoning.append(view.reasoningText);
    view.block.insertBefore(view.reasoning, view.content);
  }
  view.reasoningText.textContent += text;
}

function toolCallView(view, index) {
  if (!view.calls[index]) {
    const box = el("div", "tool-call");
    const head = el("div", "tool-head", "Tool call");
    const args = el("pre", "args");
    box.append(head, args);
    view.block.append(box);
    view.calls[index] = { box, head, args, id: "", name: "", arguments: "" };
  }
  return view.calls[index];
}

function appendToolCall(view, delta) {
  const call = toolCallView(view, delta.index || 0);
  if (delta.id) call.id = delta.id;
  if (delta.function && delta.function.name) call.name += delta.function.name;
  if (delta.function && delta.function.arguments) call.arguments += delta.function.arguments;
  call.head.textContent = `Tool call: ${call.name}` + (call.id ? ` (${call.id})` : "");
  call.args.textContent = call.arguments;
}

// Under each finished call: where its result is typed; it becomes a tool message.
function offerToolResult(call) {
  const form = el("div", "tool-result-form");
  const fieldId = "result-" + call.id;
  const label = el("label", "", `Result of ${call.name}`);
  label.htmlFor = fieldId;
  const field = el("textarea");
  field.id = fieldId;
  field.rows = 2;
  const add = el("button", "", "Add result");
  add.type = "button";
  add.addEventListener("click", () => {
    messages.push({ role: "tool", tool_call_id: call.id, content: field.value });
    form.remove();
    addToolResult(call.id, field.value);
    setStatus("Result added: press Send to let the model continue.");
    ui.prompt.focus();
  });
  form.append(label, field, add);
  call.box.append(form);
}

function showStats(view, stats) {
  const line = el("p", "stats");
  const add = (name, label, value) => {
    const item = el("span", "stat", `${label} ${value}`);
    item.dataset.stat = name;
    line.append(item);
  };
  const u = stats.usage;
  if (u) {
    const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
    add("prompt", "prompt", u.prompt_tokens);
    add("cached", "cached", cached);
    add("completion", "completion", u.completion_tokens);
  }
  if (stats.ttft !== null) add("ttft", "TTFT", `${stats.ttft.toFixed(2)} s`);
  // Decode rate: the tokens after the first, over the time after the first arrived.
  if (u && u.completion_tokens > 1 && stats.last > stats.first) {
    const rate = (u.completion_tokens - 1) / ((stats.last - stats.first) / 1000);
    add("rate", "tokens/s", rate.toFixed(1));
  }
  if (u && u.cost) {
    const peak = u.cost.off_peak ? " (off-peak)" : "";
    add("cost", "cost", `${u.cost.total.toPrecision(3)} ${u.cost.currency}${peak}`);
  }
  if (stats.stopped) add("stopped", "", "stopped");
  if (line.childElementCount) view.block.append(line);
}

function showError(view, text) {
  const p = el("p", "error", text);
  p.setAttribute("role", "alert");
  view.block.append(p);
}

// ---------------------------------------------------------------- the request

// The request's options from the settings; a problem is thrown as an Error to show.
function requestBody() {
  const body = {
    model: ui.model.value || "deepseek-chat",
    messages: ui.system.value.trim()
      ? [{ role: "system", content: ui.system.value }, ...messages] : [...messages],
    stream: true,
    stream_options: { include_usage: true },
    thinking: { type: ui.thinking.checked ? "enabled" : "disabled" },
  };
  const number = (input, name) => {
    if (input.value.trim() === "") return;
    const value = Number(input.value);
    if (!Number.isFinite(value)) throw new Error(`${name} must be a number`);
    body[name] = value;
  };
  number(ui.temperature, "temperature");
  number(ui.topP, "top_p");
  number(ui.maxTokens, "max_tokens");
  if (ui.jsonMode.checked) {
    let schema;
    try { schema = JSON.parse(ui.jsonSchema.value); }
    catch (err) { throw new Error("JSON schema: " + err.message); }
    body.response_format = {
      type: "json_schema", json_schema: { name: "answer", schema, strict: true },
    };
  }
  if (ui.tools.value.trim()) {
    let tools;
    try { tools = JSON.parse(ui.tools.value); }
    catch (err) { throw new Error("Tools: " + err.message); }
    if (!Array.isArray(tools)) throw new Error("Tools: a JSON list of functions");
    body.tools = tools.map((t) => (t.type === "function" ? t : { type: "function", function: t }));
  }
  return body;
}

// Server-sent events of a fetch body: each `data:` payload, in order (comments dropped).
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

async function send() {
  if (inFlight) return;
  const text = ui.prompt.value;
  const images = [...pending];
  if (images.some((p) => !p.url)) { setStatus("An image is still being read.", true); return; }
  const last = messages[messages.length - 1];
  const continuing = text.trim() === "" && !images.length && last && last.role === "tool";
  if (text.trim() === "" && !images.length && !continuing) return;
  // With images the content is a list of parts: the text, then the images in order.
  const content = !images.length ? text : [
    ...(text.trim() ? [{ type: "text", text }] : []),
    ...images.map((p) => ({ type: "image_url", image_url: { url: p.url } })),
  ];
  let body;
  if (!continuing) messages.push({ role: "user", content });
  try { body = requestBody(); }
  catch (err) {
    if (!continuing) messages.pop();
    setStatus(err.message, true);
    return;
  }
  if (!continuing) addUser(text, images);
  ui.prompt.value = "";
  pending.length = 0;
  showPending();
  const view = answerView();
  view.block.setAttribute("aria-busy", "true"); // screen readers read it once it is done
  const controller = new AbortController();
  const request = { controller, discard: false };
  inFlight = request;
  ui.send.disabled = true;
  ui.stop.disabled = false;
  setStatus("Generating...");
  const stats = { start: performance.now(), first: null, last: null, ttft: null,
    usage: null, stopped: false };
  const answer = { role: "assistant", content: "" };
  const seen = () => {
    const now = performance.now();
    if (stats.first === null) {
      stats.first = now;
      stats.ttft = (now - stats.start) / 1000;
    }
    stats.last = now;
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await readError(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error("Error: " + (chunk.error.message || "the stream failed"));
      if (chunk.usage) stats.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.reasoning_content) { seen(); appendReasoning(view, d.reasoning_content); }
        if (d.content) {
          seen();
          if (view.reasoning && view.reasoning.classList.contains("live")) {
            view.reasoning.classList.remove("live");
            view.reasoning.open = false; // the answer has begun: fold the reasoning
          }
          view.content.textContent += d.content;
          answer.content += d.content;
        }
        for (const call of d.tool_calls || []) { seen(); appendToolCall(view, call); }
      }
      view.block.scrollIntoView({ block: "end" });
    }
    setStatus("Done.");
  } catch (err) {
    if (err.name === "AbortError") {
      stats.stopped = true;
      setStatus("Stopped: the request was cancelled on the server too.");
    } else {
      showError(view, err.message);
      setStatus(err.message, true);
    }
  } finally {
    if (view.reasoning) view.reasoning.classList.remove("live");
    const calls = view.calls.filter(Boolean);
    if (calls.length) {
      answer.tool_calls = calls.map((c) => ({
        id: c.id, type: "function", function: { name: c.name, arguments: c.arguments },
      }));
      if (!stats.stopped) calls.forEach(offerToolResult);
    }
    if ((answer.content || answer.tool_calls) && !request.discard) messages.push(answer);
    showStats(view, stats);
    view.block.removeAttribute("aria-busy");
    inFlight = null;
    ui.send.disabled = false;
    ui.stop.disabled = true;
  }
}

// ---------------------------------------------------------------- wiring

ui.composer.addEventListener("submit", (event) => { event.preventDefault(); send(); });
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => {
  if (inFlight) inFlight.controller.abort();
  ui.prompt.focus();
});
ui.clear.addEventListener("click", () => {
  if (inFlight) {
    inFlight.discard = true;
    inFlight.controller.abort();
  }
  messages.length = 0;
  pending.length = 0;
  showPending();
  ui.log.replaceChildren();
  setStatus("New chat.");
  ui.prompt.focus();
});
ui.model.addEventListener("change", showAttach);
ui.attach.addEventListener("click", () => ui.files.click());
ui.files.addEventListener("change", () => {
  addImages([...ui.files.files]);
  ui.files.value = ""; // the same file may be picked again
});
// A pasted file inserts nothing into a textarea, so the text of a paste is left alone.
ui.prompt.addEventListener("paste", (event) => {
  addImages([...event.clipboardData.files].filter((f) => f.type.startsWith("image/")));
});
const dragsFiles = (event) => event.dataTransfer && event.dataTransfer.types.includes("Files");
ui.composer.addEventListener("dragover", (event) => {
  if (!dragsFiles(event)) return;
  event.preventDefault(); // without it the browser opens the dropped file instead
  ui.composer.classList.add("dropping");
});
ui.composer.addEventListener("dragleave", () => ui.composer.classList.remove("dropping"));
ui.composer.addEventListener("drop", (event) => {
  ui.composer.classList.remove("dropping");
  if (!dragsFiles(event)) return;
  event.preventDefault();
  addImages([...event.dataTransfer.files]);
});
ui.apiKey.value = sessionStorage.getItem(KEY_STORAGE) || "";
ui.apiKey.addEventListener("change", () => {
  const key = ui.apiKey.value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  loadModels();
});
loadModels();
