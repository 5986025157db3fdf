// The comparison page: one prompt to every ticked model, their answers streamed side by
// side from the server's own OpenAI API (server-sent events). Plain JavaScript, no
// libraries; model output is set as text, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
let running = null; // the AbortController of the answers in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function figuresText(figures) {
  if (!figures) return "no headline figures";
  return Object.entries(figures)
    .map(([k, v]) => k + " " + (typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v))
    .join(" · ");
}

function column(model) {
  const box = document.createElement("section");
  box.className = "model";
  box.dataset.model = model.id;
  const title = document.createElement("h2");
  const tick = document.createElement("input");
  tick.type = "checkbox";
  tick.checked = true;
  tick.setAttribute("aria-label", "ask " + model.id);
  title.append(tick, document.createTextNode(model.id + (model.chat ? "" : " (completion only)")));
  const figures = document.createElement("p");
  figures.className = "figures";
  figures.textContent = figuresText(model.headline);
  const answer = document.createElement("div");
  answer.className = "answer";
  const meta = document.createElement("div");
  meta.className = "meta";
  box.append(title, figures, answer, meta);
  return box;
}

async function loadModels() {
  const resp = await fetch("/v1/models", { headers: headers() });
  const body = await resp.json();
  if (!resp.ok) {
    $("status").textContent = body.error ? body.error.message : "HTTP " + resp.status;
    return;
  }
  $("status").textContent = "";
  $("columns").replaceChildren(...body.data.map(column));
}

function request(mode, model) {
  const body = {
    model: model,
    stream: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (mode === "chat") {
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    messages.push({ role: "user", content: $("prompt").value });
    body.messages = messages;
    return ["/v1/chat/completions", body];
  }
  body.prompt = $("prompt").value;
  return ["/v1/completions", body];
}

// Read a server-sent-event stream, calling onChunk with each parsed data event.
async function readEvents(resp, onChunk) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      onChunk(JSON.parse(data));
    }
  }
}

async function ask(box, mode, signal) {
  const answer = box.querySelector(".answer");
  const meta = box.querySelector(".meta");
  answer.textContent = "";
  answer.classList.remove("error");
  meta.textContent = "waiting…";
  const [path, body] = request(mode, box.dataset.model);
  const started = performance.now();
  try {
    const resp = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
    if (!resp.ok) {
      const err = await resp.json();
      throw new Error(err.error ? err.error.message : "HTTP " + resp.status);
    }
    meta.textContent = "generating…";
    await readEvents(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      answer.textContent += (mode === "chat" ? choice.delta.content : choice.text) || "";
      if (choice.finish_reason) {
        const u = chunk.usage;
        const secs = (performance.now() - started) / 1000;
        meta.textContent = choice.finish_reason + " · " + u.prompt_tokens + " prompt + " +
          u.completion_tokens + " completion tokens · " + secs.toFixed(1) + " s";
      }
    });
    box.dataset.done = "true";
  } catch (e) {
    if (e.name === "AbortError") { meta.textContent = "stopped"; return; }
    answer.classList.add("error");
    answer.textContent = e.message;
    meta.textContent = "";
    box.dataset.done = "error";
  }
}

async function send(event) {
  event.preventDefault();
  if (running) return;
  const mode = $("mode").value;
  const boxes = [...document.querySelectorAll(".model")]
    .filter((b) => b.querySelector("input[type=checkbox]").checked);
  if (!boxes.length) { $("status").textContent = "tick at least one model"; return; }
  $("status").textContent = "";
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  boxes.forEach((b) => delete b.dataset.done);
  await Promise.all(boxes.map((b) => ask(b, mode, running.signal)));
  running = null;
  $("send").disabled = false;
  $("stop").disabled = true;
}

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("submit", send);
  $("stop").addEventListener("click", () => running && running.abort());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("ask").requestSubmit();
  });
  $("api_key").addEventListener("change", loadModels);
  loadModels();
});
