// Drives brook's chat page in headless Chromium: the page loads offline, its Markdown renderer
// escapes what it must, a message streams an answer with a speed line, Stop ends a long
// answer and the model is free for the next message at once.
// Usage: node chat_page.mjs http://127.0.0.1:PORT/   (run by crates/brook-server/tests/clients.rs)
import assert from "node:assert/strict";
import { join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

// playwright-core from BROOK_TEST_BROWSER_DIR's node_modules (default: next to this file).
const modules = process.env.BROOK_TEST_BROWSER_DIR
  ? join(process.env.BROOK_TEST_BROWSER_DIR, "node_modules") : fileURLToPath(new URL("./node_modules", import.meta.url));
const { chromium } = await import(pathToFileURL(join(modules, "playwright-core", "index.mjs")).href);

const url = process.argv[2];
const executablePath = process.env.BROOK_TEST_CHROMIUM || "/usr/bin/chromium";
const browser = await chromium.launch({
  executablePath,
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
const step = (s) => console.log(`[browser] ${s}`);
try {
  const page = await browser.newPage();
  page.setDefaultTimeout(90_000);
  const problems = [];
  page.on("pageerror", (e) => problems.push(`page error: ${e}`));
  page.on("console", (m) => { if (m.type() === "error") problems.push(`console: ${m.text()}`); });
  page.on("request", (r) => { if (!r.url().startsWith(url)) problems.push(`external request: ${r.url()}`); });

  await page.goto(url);
  await page.waitForFunction(() => document.getElementById("model").textContent.includes("chat-model"));
  step("page loaded, model listed");

  const md = await page.evaluate(() => ({
    hostile: brookMarkdown('<img src=x onerror="alert(1)"> <script>alert(2)</script> [x](javascript:alert(3)) "q"'),
    code: brookMarkdown("```rust\nfn main() { let a = 1 < 2; }\n```"),
    inline: brookMarkdown("**bold** and *it* and `a<b` and [site](https://example.org/?a=1&b=2)"),
    lists: brookMarkdown("# Title\n\n- one\n- two\n\n1. first\n2. second\n\n> quoted"),
    table: brookMarkdown("| a | b |\n|---|---|\n| 1 | <i>2</i> |"),
  }));
  assert.ok(!/<img|<script|href="javascript/i.test(md.hostile), md.hostile);
  assert.ok(md.hostile.includes("&lt;img") && md.hostile.includes("&lt;script&gt;"), md.hostile);
  assert.ok(md.code.startsWith("<pre>") && md.code.includes("1 &lt; 2") && md.code.includes(">rust<"), md.code);
  assert.ok(md.inline.includes("<strong>bold</strong>") && md.inline.includes("<em>it</em>"), md.inline);
  assert.ok(md.inline.includes("<code>a&lt;b</code>"), md.inline);
  assert.ok(md.inline.includes('<a href="https://example.org/?a=1&amp;b=2"'), md.inline);
  assert.ok(md.lists.includes("<h1>Title</h1>") && md.lists.includes("<ul><li>one</li><li>two</li></ul>"), md.lists);
  assert.ok(md.lists.includes("<ol><li>first</li>") && md.lists.includes("<blockquote>"), md.lists);
  assert.ok(md.table.includes("<th>a</th>") && md.table.includes("&lt;i&gt;2"), md.table);

  // Random documents from Markdown and HTML pieces (seeded, so a failure repeats): the output
  // holds only the renderer's own tags and attributes, links only http(s), and no input makes
  // the renderer slow (backtracking).
  const fuzz = await page.evaluate(() => {
    const pieces = ["<", ">", "&", '"', "'", "[", "](", ")", "javascript:", "http://x.org/", "https://y", "data:text/html,",
      "*", "**", "_", "~~", "`", "```", "\n", "\n\n", "# ", "- ", "1. ", "> ", "|", "|---|", "<img src=x onerror=alert(1)>",
      "<script>", "</script>", "<a href='javascript:1'>", "onmouseover=", "&#106;", "\\", "text", " ", "\t", "<!--", "-->"];
    const tags = new Set(["A", "BLOCKQUOTE", "BR", "CODE", "DEL", "EM", "HR", "LI", "OL", "P", "PRE", "SPAN", "STRONG",
      "TABLE", "TBODY", "TD", "TH", "THEAD", "TR", "UL", "H1", "H2", "H3", "H4", "H5", "H6"]);
    const attrs = new Set(["href", "target", "rel", "class"]);
    let seed = 12345;
    const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
    const bad = [];
    let slowest = 0;
    for (let i = 0; i < 3000 && bad.length < 5; i++) {
      let doc = "";
      for (let k = rnd(40); k >= 0; k--) doc += pieces[rnd(pieces.length)];
      const t0 = performance.now();
      const html = brookMarkdown(doc);
      slowest = Math.max(slowest, performance.now() - t0);
      const tpl = document.createElement("template");
      tpl.innerHTML = html;
      for (const el of tpl.content.querySelectorAll("*")) {
        if (!tags.has(el.tagName)) bad.push(`tag ${el.tagName} from ${JSON.stringify(doc)}`);
        for (const a of el.attributes) {
          if (!attrs.has(a.name)) bad.push(`attribute ${a.name} from ${JSON.stringify(doc)}`);
          if (a.name === "href" && !/^https?:\/\//i.test(a.value)) bad.push(`href ${a.value} from ${JSON.stringify(doc)}`);
        }
      }
    }
    return { bad, slowest };
  });
  assert.deepEqual(fuzz.bad, []);
  assert.ok(fuzz.slowest < 200, `the renderer took ${fuzz.slowest} ms on one input`);
  step(`markdown renderer: 3000 random documents, only its own tags; slowest ${fuzz.slowest.toFixed(1)} ms`);
  step("markdown renderer escapes HTML and renders blocks");

  await page.click("#settings-toggle");
  await page.uncheck("#thinking");
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "3");
  await page.fill("#input", "Hello **there**");
  await page.click("#send");
  const lastContent = () => {
    const c = document.querySelectorAll(".msg.assistant .content");
    return c.length ? c[c.length - 1].textContent : "";
  };
  await page.waitForFunction(lastContent);
  await page.waitForFunction(() => !document.getElementById("send").disabled);
  const stats = await page.locator(".msg.assistant .stats").last().textContent();
  assert.match(stats, /^3 tokens · [\d.]+ tok\/s · prompt \d+ \(\d+ cached\)/, stats);
  assert.equal(await page.locator(".msg.user").first().textContent(), "Hello **there**");
  step(`first answer streamed: "${await page.evaluate(lastContent)}" (${stats})`);

  await page.fill("#max-tokens", "1500");
  await page.fill("#input", "Tell me a very long story.");
  await page.click("#send");
  await page.waitForFunction(() => {
    const c = document.querySelectorAll(".msg.assistant .content");
    return c.length === 2 && c[1].textContent.length > 0;
  });
  assert.equal(await page.isEnabled("#stop"), true);
  await page.click("#stop");
  await page.waitForFunction(() => document.getElementById("status").textContent === "stopped");
  assert.equal(await page.isEnabled("#send"), true);
  assert.equal(await page.isEnabled("#stop"), false);
  step(`stopped: ${await page.locator(".msg.assistant .stats").last().textContent()}`);

  await page.fill("#max-tokens", "2");
  await page.fill("#input", "Again.");
  const t0 = Date.now();
  await page.click("#send");
  await page.waitForFunction(() => document.querySelectorAll(".msg.assistant .stats").length === 3 &&
    !document.getElementById("send").disabled);
  const secs = (Date.now() - t0) / 1000;
  assert.ok(secs < 30, `the answer after Stop took ${secs} s`);
  step(`answer after Stop in ${secs.toFixed(2)} s`);

  // The CSP runs no inline script, and the API key stays in this tab's sessionStorage.
  const inline = await page.evaluate(() => {
    const s = document.createElement("script");
    s.textContent = "window.__inlineRan = true";
    document.body.appendChild(s);
    return window.__inlineRan === true;
  });
  assert.equal(inline, false, "an inline script ran despite the CSP");
  const blocked = problems.filter((p) => /inline script/i.test(p));
  assert.ok(blocked.length > 0, "the CSP violation was not reported");
  problems.splice(0, problems.length, ...problems.filter((p) => !blocked.includes(p)));
  await page.evaluate(() => { document.getElementById("api-key").value = "k-123"; saveSettings(); });
  const kept = await page.evaluate(() => ({
    local: localStorage.getItem("brook.api-key"),
    session: sessionStorage.getItem("brook.api-key"),
  }));
  assert.deepEqual(kept, { local: null, session: "k-123" });
  step("no inline script runs; the key is kept per tab");
  assert.deepEqual(problems, []);
  step("passed");
} finally {
  await browser.close();
}
