// Runs lmforge serve's page script (page.js) in Node against a live server, with just
// enough of a DOM for it, and prints what each model's column shows as JSON.
// Usage: node serve_page_harness.js PAGE_JS BASE_URL API_KEY MODE PROMPT MAX_TOKENS
// (Not a browser: it checks the page's requests and its stream reading, not its layout.)
"use strict";
const fs = require("fs");
const vm = require("vm");
const [pageJs, base, key, mode, prompt, maxTokens] = process.argv.slice(2);

class El {
  constructor(tag) {
    Object.assign(this, { tagName: tag, children: [], dataset: {}, value: "", textContent: "",
      disabled: false, checked: false, type: "", className: "", listeners: {} });
    const set = new Set();
    this.classList = { add: (c) => set.add(c), remove: (c) => set.delete(c), has: (c) => set.has(c) };
  }
  append(...xs) { this.children.push(...xs); }
  replaceChildren(...xs) { this.children = xs; }
  setAttribute() {}
  addEventListener(type, f) { this.listeners[type] = f; }
  requestSubmit() { return this.listeners.submit({ preventDefault() {} }); }
  all() { return this.children.flatMap((c) => (c instanceof El ? [c, ...c.all()] : [])); }
  querySelector(sel) {
    return this.all().find((e) => (sel === "input[type=checkbox]" ? e.type === "checkbox"
      : e.className === sel.slice(1)));
  }
}

const ids = {};
for (const id of ["ask", "system", "prompt", "mode", "temperature", "top_p", "max_tokens",
                  "seed", "api_key", "send", "stop", "status", "columns"]) ids[id] = new El("x");
Object.assign(ids.temperature, { value: "0" });
Object.assign(ids.top_p, { value: "1" });
let ready;
globalThis.document = {
  getElementById: (id) => ids[id],
  createElement: (tag) => new El(tag),
  createTextNode: (text) => ({ text }),
  querySelectorAll: (sel) => ids.columns.children.filter((c) => c.className === sel.slice(1)),
  addEventListener: (type, f) => { ready = f; },
};
const realFetch = globalThis.fetch;
globalThis.fetch = (path, options) => realFetch(base + path, options);

vm.runInThisContext(fs.readFileSync(pageJs, "utf8"), { filename: pageJs });

(async () => {
  ids.api_key.value = key;
  ready();
  for (let i = 0; i < 500 && !ids.columns.children.length; i++) await new Promise((r) => setTimeout(r, 10));
  Object.assign(ids.mode, { value: mode });
  Object.assign(ids.prompt, { value: prompt });
  Object.assign(ids.max_tokens, { value: maxTokens });
  await ids.ask.requestSubmit();
  console.log(JSON.stringify({
    status: ids.status.textContent,
    columns: ids.columns.children.map((c) => ({
      model: c.dataset.model, done: c.dataset.done || null,
      figures: c.querySelector(".figures").textContent,
      answer: c.querySelector(".answer").textContent, meta: c.querySelector(".meta").textContent,
    })),
  }));
})();
