"""The built book in a real browser, and a reader running a chapter in JupyterLab.

The pages are the book test's: the session fixture `built_book` (tests/conftest.py) executes every
chapter and builds the HTML once, and this module, run alone, builds it itself. A local HTTP server
serves them on 127.0.0.1 and Debian's headless Chromium, driven by Playwright, visits every page once:
no console error, no failed request and none to another host (the book depends on no CDN), every
image loaded, every code block highlighted, every chapter that launches a lesson showing its ranks
side by side (a failed run one line per rank first, its tracebacks folded, no build-machine path; four
ranks in readable columns; no run twice), lesson code captioned with its file, every embedded widget
view rendered, and no critical accessibility violation (axe-core,
which axe-playwright-python bundles). Then every internal link is followed, search is tried offline,
and the reader's other path is walked for real: JupyterLab opens chapter 1 and runs it down to its
first launch, whose ranks fill their panes.

No browser is downloaded (never `playwright install`): without Debian's chromium these tests are
skipped, with that reason. .ci/run installs it when it runs as root.
"""

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag

import psutil
import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from conftest import processes_with_env, still_found
from lessonlib import ROOT
from lessonlib.processes.bounded import poll_until
from test_book import BOOK_TEST_TIMEOUT, tracked_notebooks

CHROMIUM = shutil.which("chromium")
# Playwright adds its own (--headless among them); these keep Chromium off the network and the GPU.
# No host name resolves but the local server's address: a request to any other host fails at once
# (each is also recorded, and fails the test), where intercepting every request would slow every page.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
SCREENSHOTS = ROOT / "_build" / "screenshots"
SEARCH_WORD = "all_reduce"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_WAIT_MS = 15_000  # for the embedded widget manager to render a page's views
LAB_TIMEOUT = 240  # seconds for each wait of the JupyterLab test: the page, the kernel, the launch

# One worker, after the book test, sharing its build (make test: --dist loadgroup). The bound covers
# the build too, for the test that happens to trigger it; every wait below has its own, shorter one.
pytestmark = [pytest.mark.xdist_group("book"), pytest.mark.timeout(BOOK_TEST_TIMEOUT + 600)]


# --------------------------------------------------------------------------- the server and the browser


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # one line per request would drown a failure's output
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # The browser drops connections it no longer needs (a page left mid-load): not an error to print.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(folder):
    """`folder` over HTTP on 127.0.0.1 at a free port, in a thread; yields the base URL."""
    server = QuietServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, name="book-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip(
            "no chromium on PATH: the browser tests use Debian's (apt-get install chromium; "
            ".ci/run installs it when run as root) and never download one"
        )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, timeout=60_000)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def book_html(built_book):
    if not built_book.ok:
        pytest.fail(
            "the book did not build, so there are no pages to open: "
            "test_book_builds_and_executes_every_chapter says why",
            pytrace=False,
        )
    return built_book.html


@pytest.fixture(scope="module")
def site(book_html):
    with serve(book_html) as base:
        yield base


@dataclass
class Traffic:
    """What pages asked for and said: requests to other hosts, failed requests, console errors."""

    base: str
    foreign: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def open_context(browser, base):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    return context, Traffic(base)


def watch(page, traffic, label):
    """Record `page`'s console errors, uncaught exceptions, failed requests and requests to other
    hosts (which the browser cannot reach: CHROMIUM_FLAGS) under `label`."""

    def console(msg):
        if msg.type == "error":
            where = msg.location.get("url", "") if msg.location else ""
            traffic.errors.append(f"{label}: {msg.text}" + (f" ({where})" if where else ""))

    def request(req):
        if not req.url.startswith((traffic.base, "data:", "blob:", "about:")):
            traffic.foreign.append(f"{label}: {req.url}")

    page.on("console", console)
    page.on("pageerror", lambda exc: traffic.errors.append(f"{label}: uncaught {exc}"))
    page.on("request", request)
    page.on(
        "requestfailed",
        lambda req: req.url.startswith(traffic.base) and traffic.failed.append(f"{label}: {req.url} ({req.failure})"),
    )
    page.on(
        "response",
        lambda resp: resp.status >= 400 and traffic.failed.append(f"{label}: {resp.url} (HTTP {resp.status})"),
    )


# --------------------------------------------------------------------------- what a page holds

WAIT_FOR_IMAGES = """async () => {
  const images = Array.from(document.images);
  images.forEach(img => { if (img.loading === "lazy") img.loading = "eager"; });
  const settled = Promise.all(images.map(img => img.decode().catch(() => null)));
  await Promise.race([settled, new Promise(done => setTimeout(done, 10000))]);
}"""

# Everything the checks need from one page, in one round trip.
PAGE_FACTS = r"""(root) => {
  const shown = el => {
    const box = el.getBoundingClientRect(), style = getComputedStyle(el);
    // checkVisibility: a closed <details> (a hide-cell toggle) lays its content out all the same.
    return box.width > 0 && box.height > 0 && style.visibility !== "hidden" && el.checkVisibility();
  };
  const images = Array.from(document.images).map(img => ({
    src: img.currentSrc || img.src, ok: img.complete && img.naturalWidth > 0}));
  const links = Array.from(document.querySelectorAll("a[href]")).map(a => a.href);
  const blocks = Array.from(document.querySelectorAll("div.highlight pre")).map(pre => {
    const box = pre.closest('[class*="highlight-"]');
    const language = box ? (box.className.match(/\bhighlight-(\S+)/) || [])[1] : null;
    const tokens = Array.from(pre.querySelectorAll("span[class]"));
    const plain = getComputedStyle(pre).color;
    return {language, tokens: tokens.length, text: pre.textContent.trim().slice(0, 80),
            coloured: tokens.some(t => getComputedStyle(t).color !== plain)};
  });
  // Each run view (lessonlib.view.html): its head, the line per rank of a failed run, its columns (ranks
  // that printed something), the ranks named on its one line for those that printed nothing, its folded
  // tracebacks, and any absolute path of the build machine it shows (an environment's, the checkout's).
  const runs = Array.from(document.querySelectorAll(".lessonlib-run")).map(run => {
    const grid = Array.from(run.children).find(c => getComputedStyle(c).display === "grid");
    const summary = run.querySelector(":scope > .lessonlib-summary");
    const quiet = run.querySelector(":scope > .lessonlib-quiet");
    const columns = grid ? Array.from(grid.children).map(col => {
      const box = col.getBoundingClientRect();
      // textContent, not innerText: innerText is "" inside a closed toggle, which a reader opens.
      const text = Array.from(col.querySelectorAll("pre")).map(pre => pre.textContent).join("\n");
      return {title: (col.querySelector("b") || {}).textContent || "", shown: shown(col),
              lines: text.split("\n").filter(line => line.trim()).length,
              left: box.left, top: box.top, width: box.width};
    }) : [];
    const text = run.textContent;
    return {head: (run.firstElementChild || run).textContent.trim().slice(0, 120),
            worldSize: Number(run.dataset.worldSize || 0),
            summary: summary ? {shown: shown(summary), bottom: summary.getBoundingClientRect().bottom,
                                lines: Array.from(summary.children).map(li => li.textContent.trim())} : null,
            gridTop: grid ? grid.getBoundingClientRect().top : null,
            scrolls: grid ? grid.scrollWidth > grid.clientWidth + 1 : false,
            quietRanks: quiet ? quiet.dataset.ranks.split(",").map(Number) : [],
            tracebacks: Array.from(run.querySelectorAll("details.lessonlib-traceback")).map(d => ({
              open: d.open, grey: d.querySelectorAll(".lessonlib-lib").length})),
            longPaths: (text.match(/\/\S*?(site|dist)-packages\/\S*/g) || [])
              .concat(root && text.includes(root + "/") ? [root + "/"] : []).slice(0, 3),
            columns};
  });
  // Cells that show more than one run view, each view as a hash of its text: the same run twice is a bug.
  const hash = text => {
    let h = 0;
    for (let i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) | 0;
    return h;
  };
  const repeated = Array.from(document.querySelectorAll("div.cell"))
    .map(cell => Array.from(cell.querySelectorAll(".lessonlib-run")).map(run => hash(run.textContent)))
    .filter(hashes => hashes.length > 1);
  // Lesson code (lessonlib.show_code cells): its caption, and the code block inside the framed box.
  const lessonCode = Array.from(document.querySelectorAll("div.cell.tag_lesson-code")).map(cell => {
    const box = cell.querySelector(".lessonlib-code"), caption = cell.querySelector(".lessonlib-code-caption");
    const pre = cell.querySelector("div.highlight pre");
    return {caption: caption ? caption.textContent.trim() : null, shown: caption ? shown(caption) : false,
            captionBottom: caption ? caption.getBoundingClientRect().bottom : null,
            codeTop: pre ? pre.getBoundingClientRect().top : null,
            rule: box ? parseFloat(getComputedStyle(box).borderLeftWidth) : 0,
            framed: !!(box && pre && caption && box.contains(pre) && box.contains(caption))};
  });
  const captionedOwnCells = document.querySelectorAll("div.cell:not(.tag_lesson-code) .lessonlib-code-caption").length;
  return {title: document.title, images, links, blocks, runs, repeated, lessonCode, captionedOwnCells};
}"""

# Each embedded widget view, and whether it rendered: html-manager puts the view in an element beside its
# <script> (html-manager 8 just before it), so an element next to the script that holds a widget's DOM,
# and that no other script has claimed, is that script's view.
WIDGET_VIEWS = """(type) => {
  const claimed = new Set();
  const isView = el => !!el && !claimed.has(el) && /widget/.test(el.className) && (
      el.classList.contains("jupyter-widgets") || el.querySelector('.jupyter-widgets, [class*="widget-"]') !== null);
  return Array.from(document.querySelectorAll(`script[type="${type}"]`)).map(script => {
    let model = "?";
    try { model = JSON.parse(script.textContent).model_id; } catch (e) {}
    const view = [script.previousElementSibling, script.nextElementSibling].find(isView);
    if (view) claimed.add(view);
    const beside = [script.previousElementSibling, script.nextElementSibling]
        .map(el => el ? el.outerHTML.slice(0, 80) : "nothing").join(" | ");
    return {model, rendered: !!view, beside};
  });
}"""


def widget_views(page, wait_ms=WIDGET_WAIT_MS):
    """[{model, rendered, beside}] for every embedded widget view on `page`, once they had time to render."""
    if page.locator(f'script[type="{WIDGET_VIEW}"]').count() == 0:
        return []
    with contextlib.suppress(PlaywrightTimeout):  # the state below says which did not render
        page.wait_for_function(
            f"(type) => ({WIDGET_VIEWS})(type).every(v => v.rendered)", arg=WIDGET_VIEW, timeout=wait_ms
        )
    return page.evaluate(WIDGET_VIEWS, WIDGET_VIEW)


@dataclass
class Page:
    name: str
    facts: dict
    widgets: list
    axe: list  # axe-core violations


def launch_chapters():
    """Page names of the chapters whose notebook launches a lesson."""
    return sorted(p.stem + ".html" for p in tracked_notebooks() if "lessonlib.launch(" in p.read_text())


def book_pages(html):
    """Every top-level page but index.html, which only redirects to the intro (checked on its own)."""
    return sorted(p.name for p in html.glob("*.html") if p.name != "index.html")


# axe-core's preload fetches every stylesheet again itself and resolves their @imports against the
# page instead of the sheet (a request for /basic.css that 404s); the one rule that needs it,
# css-orientation-lock, is not worth a failed request the book did not make.
AXE_OPTIONS = {"resultTypes": ["violations"], "preload": False}
# color-contrast is most of axe's time (6.5 of 8 s on chapter 1, on the 2-core machine) and can only be
# serious, never critical. Every page has the same colours (the theme, Pygments, the launcher's
# inline styles), so it runs on the two screenshot pages, which have them all; the rest get every
# other rule.
AXE_NO_CONTRAST = {**AXE_OPTIONS, "rules": {"color-contrast": {"enabled": False}}}


@pytest.fixture(scope="module")
def visit(book_html, site, browser):
    """Every page visited once: ({name: Page}, the traffic of the whole visit)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    context, traffic = open_context(browser, site)
    axe, pages, seconds = Axe(), {}, {"load": 0.0, "axe": 0.0}
    shots = {"intro.html", *launch_chapters()[:1]}
    started = time.monotonic()
    try:
        page = context.new_page()
        watch(page, traffic, "index.html")
        page.goto(site + "index.html")
        page.wait_for_url(site + "intro.html")  # index.html only redirects
        page.close()
        for name in book_pages(book_html):
            t0 = time.monotonic()
            page = context.new_page()
            watch(page, traffic, name)
            page.goto(site + name, wait_until="load")
            page.evaluate(WAIT_FOR_IMAGES)
            facts, widgets = page.evaluate(PAGE_FACTS, str(ROOT)), widget_views(page)
            t1 = time.monotonic()
            options = AXE_OPTIONS if name in shots else AXE_NO_CONTRAST
            violations = axe.run(page, options=options).response["violations"]
            seconds["load"] += t1 - t0
            seconds["axe"] += time.monotonic() - t1
            pages[name] = Page(name, facts, widgets, violations)
            if name in shots:
                run = page.locator(".lessonlib-run").first
                if run.count():
                    run.scroll_into_view_if_needed()
                page.screenshot(path=SCREENSHOTS / f"{Path(name).stem}.png")
            page.close()
    finally:
        context.close()
    print(
        f"\nbrowser: {len(pages)} pages in {time.monotonic() - started:.1f} s (loading and looking "
        f"{seconds['load']:.1f} s, axe {seconds['axe']:.1f} s)"
    )
    return pages, traffic


# --------------------------------------------------------------------------- the checks


def test_pages_log_no_console_errors(visit):
    _, traffic = visit
    assert not traffic.errors, "console errors:\n" + "\n".join(traffic.errors)


def test_site_root_has_a_favicon(site):
    """index.html has no <link rel=icon>, so a browser may ask for /favicon.ico before it redirects
    (a 404 in the console if it is missing). The site root must answer it."""
    with urllib.request.urlopen(site + "favicon.ico", timeout=10) as response:
        body = response.read()
    assert response.status == 200 and body[:4] == b"\x00\x00\x01\x00", "favicon.ico is not an icon"


def test_pages_load_everything_from_the_local_server(visit):
    pages, traffic = visit
    assert not traffic.foreign, "requests to other hosts (the book must not need a CDN):\n" + "\n".join(
        sorted(set(traffic.foreign))
    )
    assert not traffic.failed, "failed requests:\n" + "\n".join(traffic.failed)
    broken = [f"{p.name}: {img['src']}" for p in pages.values() for img in p.facts["images"] if not img["ok"]]
    assert not broken, "images that did not load:\n" + "\n".join(broken)


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids.update(v for k, v in attrs.items() if k == "id" or (tag == "a" and k == "name"))


def test_internal_links_resolve(visit, site):
    """Every local link of every page: each target fetched once, each #anchor present in it."""
    pages, _ = visit
    uses = {}
    for page in pages.values():
        for href in page.facts["links"]:
            if href.startswith(site):
                target, anchor = urldefrag(href)
                uses.setdefault(target, []).append((anchor, page.name))
    assert uses, "no internal links found"
    problems = []
    for target, linked in sorted(uses.items()):
        try:
            with urllib.request.urlopen(target, timeout=30) as response:
                parser = _Ids()
                parser.feed(response.read().decode("utf-8", "replace"))
        except urllib.error.URLError as exc:
            problems.append(f"{target} ({exc}), linked from {sorted({n for _, n in linked})}")
            continue
        for anchor, name in sorted(set(linked)):
            if anchor and unquote(anchor) not in parser.ids:
                problems.append(f"{name} links to {target}#{anchor}: no such id there")
    assert not problems, "broken internal links:\n" + "\n".join(problems)


PLAIN = {"none", "text", "myst-ansi", "default-text"}  # blocks that are text by intent: outputs, logs


def test_code_blocks_are_highlighted(visit):
    """Every code block carries Pygments' token spans, and the theme's colours reach them."""
    pages, _ = visit
    bare, colourless = [], []
    for page in pages.values():
        code = [b for b in page.facts["blocks"] if b["language"] not in PLAIN and b["text"]]
        bare += [f"{page.name} ({b['language']}): {b['text']!r}" for b in code if not b["tokens"]]
        if code and not any(b["coloured"] for b in code):
            colourless.append(page.name)
    assert not bare, "code blocks without highlighting:\n" + "\n".join(bare)
    assert not colourless, f"pages whose code has token spans but no colours (pygments.css?): {colourless}"


def test_every_launch_chapter_shows_its_ranks_side_by_side(visit):
    """Each chapter that launches shows at least one run. In every run each rank is accounted for: a
    column with its output, or named on the run's one line for the ranks that printed nothing (many
    lessons print from rank 0 only; those ranks take no column, rather than an empty box each); runs inside
    a closed toggle (an exercise's hidden solution) included, since a reader opens it. Where two or more
    visible ranks printed, their first two columns stand side by side; and some run in the book shows two
    columns with output side by side."""
    pages, _ = visit
    missing, unaccounted, blank, stacked, side_by_side = [], [], [], [], []
    for name in launch_chapters():
        runs = [run for run in pages[name].facts["runs"] if run["worldSize"]]
        if not runs:
            missing.append(f"{name}: no lessonlib-run block")
        for run in runs:
            where = f"{name}: {run['head']}"
            ranks = [int(c["title"].split()[1]) for c in run["columns"] if re.fullmatch(r"rank \d+", c["title"])]
            if sorted(ranks + run["quietRanks"]) != list(range(run["worldSize"])):
                unaccounted.append(f"{where}: columns {ranks}, printed nothing {run['quietRanks']}")
            blank += [f"{where}: {c['title']}" for c in run["columns"] if not c["lines"]]
            shown = [c for c in run["columns"] if c["shown"]]
            if len(shown) >= 2:
                if abs(shown[0]["top"] - shown[1]["top"]) < 2 and shown[1]["left"] > shown[0]["left"]:
                    side_by_side.append(name)
                else:
                    stacked.append(f"{where}: {shown[:2]}")
    assert not missing, "\n".join(missing)
    assert not unaccounted, "ranks neither shown in a column nor named as printing nothing:\n" + "\n".join(unaccounted)
    assert not blank, "rank columns left blank (a rank that printed nothing takes no column):\n" + "\n".join(blank)
    assert not stacked, "rank columns one under the other instead of side by side:\n" + "\n".join(stacked)
    assert side_by_side, "no run in the book shows two rank columns side by side"


def test_a_failed_launch_leads_with_each_ranks_line_and_folds_its_tracebacks(visit):
    """Chapter 1's failing launches (a rank that raises, one that stalls, one the launch's own bound
    ends): each view says first, one visible line per rank above the columns, how the rank ended and
    where it was; every traceback and stack is folded (a closed <details>), torch's frames greyed inside;
    and no run in the book shows an absolute path of the build machine (an environment's site-packages,
    the checkout)."""
    pages, _ = visit
    runs = pages["01_launch.html"].facts["runs"]
    failed = [run for run in runs if re.match(r"^\W*(failed|timed out|interrupted)", run["head"])]
    assert len(failed) >= 3, f"chapter 1 shows {len(failed)} failed runs: {[r['head'] for r in runs]}"
    for run in failed:
        summary = run["summary"]
        assert summary and summary["shown"], f"no visible line per rank: {run['head']}"
        said = [re.match(r"rank (\d+)\b", line) for line in summary["lines"]]
        assert [int(m[1]) for m in said if m] == list(range(run["worldSize"])), summary["lines"]
        assert run["gridTop"] is None or summary["bottom"] <= run["gridTop"] + 1, "the rank lines are not first"
        assert run["tracebacks"], f"no traceback or stack folded under a rank: {run['head']}"
        assert not any(t["open"] for t in run["tracebacks"]), f"a traceback shown open: {run['head']}"
    assert any(t["grey"] for run in failed for t in run["tracebacks"]), "no torch frame greyed in any traceback"
    shown = [f"{name}: {path}" for name, p in pages.items() for run in p.facts["runs"] for path in run["longPaths"]]
    assert not shown, "absolute paths of the build machine in run views:\n" + "\n".join(shown[:10])


def test_four_ranks_keep_readable_columns(visit):
    """A run's columns are at least ~250 px wide each (the view's minimum is 22em, 264 px), or their row
    scrolls sideways: checked on every page, and on a 4-rank run of a chapter that launches one."""
    pages, _ = visit
    narrow = [
        f"{name}: {run['head']}: {[round(c['width']) for c in run['columns'] if c['shown']]}"
        for name, p in pages.items()
        for run in p.facts["runs"]
        if not run["scrolls"] and any(c["width"] < 250 for c in run["columns"] if c["shown"])
    ]
    assert not narrow, "rank columns narrower than 250 px, not scrolling:\n" + "\n".join(narrow)
    four = [p.stem + ".html" for p in tracked_notebooks() if re.search(r"\bnproc=4\b", p.read_text())]
    wide = [
        run
        for name in four
        for run in pages[name].facts["runs"]
        if run["worldSize"] == 4 and len([c for c in run["columns"] if c["shown"]]) >= 2
    ]
    assert wide, f"no 4-rank run with two or more visible columns on {four}"


def test_no_cell_shows_the_same_run_twice(visit):
    """A cell whose last line is `lessonlib.launch(...).raise_for_status()` shows the launch's own view,
    not that view and the returned RunResult again."""
    pages, _ = visit
    repeated = [
        f"{name}: a cell shows {len(hashes)} run views, {len(hashes) - len(set(hashes))} of them repeated"
        for name, p in pages.items()
        for hashes in p.facts["repeated"]
        if len(set(hashes)) < len(hashes)
    ]
    assert not repeated, "\n".join(repeated)


def test_lesson_code_is_captioned_with_its_file(visit):
    """Every lesson-code cell (lessonlib.show_code) carries a caption bar naming the lesson file and the
    region or function, above the highlighted code, inside a box with a rule down its left side, so it
    never reads as one of the notebook's own cells (which carry none)."""
    pages, _ = visit
    bad, seen = [], 0
    for name, p in pages.items():
        bad += [f"{name}: captioned code in a notebook's own cell"] * p.facts["captionedOwnCells"]
        for code in p.facts["lessonCode"]:
            seen += 1
            caption = code["caption"] or ""
            if not re.fullmatch(
                r"(lessons|lessons/recipes|lessonlib(/\w+)?)/\w+\.py · ((region|function|class) [\w.-]+|whole file)"
                r"|lessons/slurm/\w+\.sbatch · region \w+",  # chapter 17's job scripts
                caption,
            ) and not re.fullmatch(r"diff · lessons/\w+\.py.* → lessons/\w+\.py.*", caption):
                bad.append(f"{name}: caption {code['caption']!r}")
            elif not code["framed"] or code["rule"] < 2:
                bad.append(f"{name}: {caption}: not framed (rule {code['rule']} px)")
            elif code["shown"] and code["captionBottom"] > code["codeTop"] + 1:
                bad.append(f"{name}: {caption}: the caption is not above its code")
    assert seen, "no lesson-code cell found"
    assert not bad, "lesson code without its caption:\n" + "\n".join(bad)


def test_the_start_page_comes_first_with_the_script_its_diffs_and_a_step(visit, book_html):
    """Start here: first in the navigation, linked from the intro, showing train_ddp.py whole and the three
    diffs (one process to DDP, AMP, another task; highlighted, captioned), the picture of one DDP step, and
    the runs of the script."""
    pages, _ = visit
    assert "start.html" in pages, f"no Start page among {sorted(pages)}"
    start = pages["start.html"].facts
    captions = [c["caption"] for c in start["lessonCode"]]
    assert "lessons/train_ddp.py · whole file" in captions, captions
    diffs = [c for c in captions if c.startswith("diff · ")]
    assert len(diffs) == 3, f"the Start page should show three diffs, it shows {diffs}"
    assert diffs[-1] == "diff · lessons/train_ddp.py → lessons/train_regression.py", diffs
    highlighted = [b for b in start["blocks"] if b["language"] == "diff" and b["tokens"]]
    assert len(highlighted) == 3, "the diffs are not highlighted as diffs"
    assert any(img["ok"] for img in start["images"]), "the picture of one DDP step did not load"
    assert len(start["runs"]) >= 3, "the step and the two train_ddp.py runs should each show their ranks"
    intro = (book_html / "intro.html").read_text()
    assert 'href="start.html"' in intro, "the intro does not link to the Start page"
    nav = intro[intro.index("bd-sidebar") :]
    assert nav.index("start.html") < nav.index("01_launch.html"), "Start here is not first among the chapters"


def test_embedded_widget_views_render(visit):
    pages, _ = visit
    dead = [
        f"{p.name}: model {v['model']} (beside its script: {v['beside']})"
        for p in pages.values()
        for v in p.widgets
        if not v["rendered"]
    ]
    assert not dead, "embedded widget views that did not render:\n" + "\n".join(dead)


def test_widget_check_fails_on_a_view_that_does_not_render(browser, tmp_path):
    """The check above on made-up pages: views rendered before and after their script pass, a view left
    unrendered fails, and one rendered view does not count for two scripts."""

    def view(model):
        state = json.dumps({"version_major": 2, "version_minor": 0, "model_id": model})
        return f'<script type="{WIDGET_VIEW}">{state}</script>'

    rendered = '<div class="widget-subarea"><div class="lm-Widget jupyter-widgets widget-label">ranks: 2</div></div>'
    pages = {
        "before.html": rendered + view("m1"),
        "after.html": view("m1") + rendered,
        "dead.html": view("m1") + "<p>no manager loaded</p>",
        "one_for_two.html": view("m1") + rendered + view("m2"),
    }
    for name, body in pages.items():
        (tmp_path / name).write_text(f"<!doctype html><title>t</title><body><div>{body}</div>")
    with serve(tmp_path) as base:
        context, _ = open_context(browser, base)
        try:
            page = context.new_page()
            seen = {}
            for name in pages:
                page.goto(base + name)
                seen[name] = [(v["model"], v["rendered"]) for v in widget_views(page, wait_ms=1000)]
        finally:
            context.close()
    assert seen == {
        "before.html": [("m1", True)],
        "after.html": [("m1", True)],
        "dead.html": [("m1", False)],
        "one_for_two.html": [("m1", True), ("m2", False)],
    }, seen


def test_no_critical_accessibility_violations(visit):
    """axe-core on every page (color-contrast on two: AXE_NO_CONTRAST): critical violations fail, serious
    ones are reported as warnings."""
    pages, _ = visit
    critical, serious = [], {}
    for page in pages.values():
        for v in page.axe:
            where = f"{page.name}: {v['id']} ({v['help']}) at " + ", ".join(
                " ".join(n["target"]) if isinstance(n["target"], list) else str(n["target"]) for n in v["nodes"][:5]
            )
            if v["impact"] == "critical":
                critical.append(where)
            elif v["impact"] == "serious":
                serious.setdefault(v["id"], []).append(where)
    for rule, found in serious.items():
        warnings.warn(
            f"axe, serious (not failing): {rule} on {len(found)} page(s):\n" + "\n".join(found[:5]), stacklevel=1
        )
    assert not critical, "critical accessibility violations:\n" + "\n".join(critical)


def test_screenshots_were_written(visit):
    for name in ["intro.html", *launch_chapters()[:1]]:
        shot = SCREENSHOTS / f"{Path(name).stem}.png"
        assert shot.exists() and shot.stat().st_size > 10_000, f"{shot} missing or blank"


def test_search_works_offline(book_html, site, browser):
    """Sphinx's search page, given a word the book uses, lists pages that contain it: no server, no CDN."""
    holding = {p.name for p in book_html.glob("*.html") if SEARCH_WORD in p.read_text() and p.name != "search.html"}
    assert holding, f"no page contains {SEARCH_WORD!r}: pick a word the book uses"
    context, traffic = open_context(browser, site)
    try:
        page = context.new_page()
        watch(page, traffic, "search.html")
        page.goto(f"{site}search.html?q={SEARCH_WORD}")
        page.wait_for_selector("#search-results ul.search li a", timeout=30_000)
        found = {
            urldefrag(h)[0].removeprefix(site)
            for h in page.eval_on_selector_all("#search-results ul.search li a", "links => links.map(a => a.href)")
        }
    finally:
        context.close()
    assert found & holding, f"search for {SEARCH_WORD!r} found {sorted(found)}, none of {sorted(holding)}"
    assert not (traffic.errors or traffic.failed or traffic.foreign), traffic


# --------------------------------------------------------------------------- a reader in JupyterLab

LAB_SETTINGS = {
    # Nothing the test runs may be saved into the chapter, which must stay without outputs.
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    # Every cell in the DOM, not only those scrolled into view.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    # No news or update checks: nothing leaves the machine, no toast over the notebook.
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

# Every distinct state of every lessonlib-run block in the notebook, as the launcher redraws it.
RECORD_RUNS = r"""() => {
  window.__runs = [];
  let last = "";
  const snapshot = () => {
    const runs = Array.from(document.querySelectorAll(".jp-Notebook .lessonlib-run")).map(run => {
      const grid = Array.from(run.children).find(c => getComputedStyle(c).display === "grid");
      return {head: (run.firstElementChild || run).textContent.trim(),
              columns: grid ? Array.from(grid.children).map(col => ({
                title: (col.querySelector("b") || {}).textContent || "",
                lines: ((col.querySelector("pre") || {}).innerText || "").split("\n").filter(l => l.trim())})) : []};
    });
    const text = JSON.stringify(runs);
    if (runs.length && text !== last) { window.__runs.push(runs); last = text; }
  };
  new MutationObserver(snapshot).observe(document.body, {childList: true, subtree: true, characterData: true});
}"""


def first_launch_cell(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    return next(
        i for i, c in enumerate(cells) if c["cell_type"] == "code" and "lessonlib.launch(" in "".join(c["source"])
    )


def lab_processes(mark):
    """Live processes that carry this Lab's marker in their environment: the server, its kernels, their launches."""
    return processes_with_env("COURSE_LAB_MARK", mark)


@contextlib.contextmanager
def jupyterlab(tmp):
    """JupyterLab from .venv on 127.0.0.1, its config, data and runtime under `tmp` (nothing written to
    the home folder), stopped at the end with every kernel and process it started.
    Yields (url, token, its log file)."""
    token, mark = uuid.uuid4().hex, uuid.uuid4().hex
    for plugin, values in LAB_SETTINGS.items():
        path = tmp / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(
        os.environ,
        COURSE_LAB_MARK=mark,
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        IPYTHONDIR=str(tmp / "ipython"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
    )
    cmd = [
        str(Path(sys.executable).with_name("jupyter-lab")),
        "--no-browser",
        "--ip=127.0.0.1",
        "--ServerApp.port=0",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={ROOT}",
    ]
    if os.geteuid() == 0:  # CI containers run as root; Jupyter refuses that unless told
        cmd.append("--allow-root")
    log = open(tmp / "lab.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = None

    def said():
        log.seek(0)
        return f"(exit {proc.poll()}):\n{log.read()[-3000:]}"

    def lab_url():
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab did not start {said()}")
        for info in (tmp / "runtime").glob(f"jpserver-{proc.pid}.json"):
            with contextlib.suppress(ValueError):
                return f"http://127.0.0.1:{json.loads(info.read_text())['port']}/"
        return None

    try:
        url = poll_until(lab_url, 120, interval=0.2, what=lambda: f"JupyterLab to start {said()}")
        yield url, token, log
    finally:
        leftovers = stop_lab(proc, url, token, mark)
        log.close()
    assert not leftovers, "processes left behind by JupyterLab's shutdown (now killed):\n" + "\n".join(leftovers)


def stop_lab(proc, url, token, mark):
    """Shut the server down as a reader's Ctrl-C would (kernels first), then make sure: SIGTERM, SIGKILL.
    Returns what was still alive after the polite shutdown (each is killed)."""
    if url and proc.poll() is None:
        with contextlib.suppress(OSError):
            request = urllib.request.Request(
                url + "api/shutdown", method="POST", headers={"Authorization": f"token {token}"}
            )
            urllib.request.urlopen(request, timeout=10).close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    left = still_found(lambda: lab_processes(mark), 10, 0.2)  # kernels that were told to stop, still stopping
    described = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
    psutil.wait_procs(left, timeout=5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return described


# Needs no built book. Its marks name the groups "book" and "lab", which pytest-xdist joins into a
# group of its own ("book_lab"): it then runs beside the book build, not after it on the book's worker.
@pytest.mark.xdist_group("lab")
@pytest.mark.timeout(3 * LAB_TIMEOUT + 300)
def test_a_reader_runs_chapter_1_to_its_first_launch_in_jupyterlab(browser, tmp_path):
    """The reader's path: chapter 1 opened in JupyterLab, its cells run from the top through the first
    `lessonlib.launch(` cell with Shift+Enter, and each rank's pane seen filling with its lines, live,
    then side by side. The chapter is the real one; nothing is saved into it (autosave off, and checked)."""
    notebook = ROOT / "book" / "01_launch.ipynb"
    launch = first_launch_cell(notebook)
    kernel_name = json.loads(notebook.read_text())["metadata"]["kernelspec"]["name"]
    spec = Path(sys.prefix) / "share" / "jupyter" / "kernels" / kernel_name / "kernel.json"
    assert spec.exists(), f"the chapter's kernel {kernel_name!r} is not registered in .venv (make setup does it)"
    kernel_title = json.loads(spec.read_text())["display_name"]
    checkpoints_existed = (notebook.parent / ".ipynb_checkpoints").exists()
    with jupyterlab(tmp_path) as (url, token, log):
        # JupyterLab's own console errors and requests to other hosts (blocked) are not the course's
        # doing and are not checked here; what the chapter shows is.
        context, _ = open_context(browser, url)
        context.set_default_timeout(LAB_TIMEOUT * 1000)
        try:
            page = context.new_page()
            page.goto(f"{url}lab/tree/book/{notebook.name}?token={token}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
            kernel = page.locator(".jp-NotebookPanel-toolbar .jp-KernelName").first
            # The chapter's own kernel, started without a "select kernel" dialog.
            page.wait_for_function(
                "(title) => document.querySelector('.jp-NotebookPanel-toolbar "
                ".jp-KernelName')?.textContent.trim() === title",
                arg=kernel_title,
            )
            page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]')
            page.evaluate(RECORD_RUNS)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")  # command mode: Shift+Enter runs a cell and selects the next
            for _ in range(launch + 1):
                page.keyboard.press("Shift+Enter")
            try:  # the launch's view stops saying "running" when the run is over, however it ended
                page.wait_for_function(
                    "() => window.__runs.some(runs => !/running/.test(runs[0].head))", timeout=LAB_TIMEOUT * 1000
                )
            except PlaywrightTimeout:
                outputs = page.locator(".jp-Notebook .jp-OutputArea").all_inner_texts()
                log.seek(0)
                pytest.fail(
                    f"no finished launch shown in {LAB_TIMEOUT} s; kernel: {kernel.inner_text()!r}; "
                    f"outputs:\n{chr(10).join(outputs)[-3000:]}\nJupyterLab's log:\n{log.read()[-2000:]}"
                )
            states = [runs[0] for runs in page.evaluate("window.__runs")]
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.locator(".jp-Notebook .lessonlib-run").first.scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / "jupyterlab_01_launch.png")
            panel = run_a_panel_through_its_controls(page, log)
        finally:
            context.close()  # closes the notebook without saving it
    if not checkpoints_existed:
        shutil.rmtree(notebook.parent / ".ipynb_checkpoints", ignore_errors=True)
    saved = [
        i
        for i, c in enumerate(json.loads(notebook.read_text())["cells"])
        if c.get("outputs") or c.get("execution_count")
    ]
    assert not saved, f"JupyterLab saved outputs into {notebook} (cells {saved}): strip them"

    live = [s for s in states if "running" in s["head"]]
    final = states[-1]
    assert re.match(r"^\W*ok:", final["head"]), f"the launch did not succeed: {final}"
    ranks = [f"rank {r}" for r in range(len(final["columns"]))]
    assert live, f"the live view never showed: {states[:3]}"
    assert len(final["columns"]) >= 2 and [c["title"] for c in final["columns"]] == ranks, final
    empty = [c["title"] for c in final["columns"] if not c["lines"]]
    assert not empty, f"final view: empty panes {empty}: {final}"
    filled_live = {c["title"] for s in live for c in s["columns"] if c["lines"]}
    assert filled_live == set(ranks), f"the live view filled only {sorted(filled_live)} of {ranks}: {live[-1]}"
    print(f"\nJupyterLab: {len(live)} live redraws, then {final['head']!r}")
    assert re.match(r"^\W*ok: torchrun --nproc_per_node=3 ", panel["head"]), panel
    assert [c["title"] for c in panel["columns"]] == ["rank 0", "rank 1", "rank 2"], panel
    assert all(c["lines"] for c in panel["columns"]), f"a panel column stayed empty: {panel}"
    assert "stopped: every process of the run was killed" in panel["stopped"], panel
    print("run panel: 3 ranks run from its controls, then a run stopped with its Stop button")


PANEL_CELL = 'panel = lessonlib.panel("lessons/01_launch.py", nproc=2)\npanel'


def run_a_panel_through_its_controls(page, log):
    """In the open chapter, a new cell with a run panel; through its widgets: ranks set to 3, Run, the
    three columns filled; then --stall-rank 1, Run, Stop. Returns what the page showed. (panel.result
    is checked from a kernel in tests/test_panel.py.)"""

    def type_cell(code):
        page.keyboard.press("Escape")
        page.keyboard.press("b")  # a new cell below, in command mode
        page.keyboard.press("Enter")  # edit it
        page.keyboard.insert_text(code)
        page.keyboard.press("Shift+Enter")

    page.locator(".jp-Notebook .jp-Cell").last.click()
    type_cell(PANEL_CELL)
    box = page.locator(".lessonlib-panel").last
    box.wait_for()
    ranks = box.locator(".widget-inline-hbox", has_text="ranks").locator("input")
    ranks.fill("3")
    ranks.press("Enter")
    box.locator("button", has_text="Run").click()
    try:  # the output widget's HTML is replaced at every redraw: look it up inside the panel each time
        page.wait_for_function(
            "(box) => { const h = box.querySelector('.lessonlib-run > div'); "
            "return h !== null && /^\\W*(ok|failed|timed out)/.test(h.textContent.trim()); }",
            arg=box.element_handle(),
            timeout=LAB_TIMEOUT * 1000,
        )
    except PlaywrightTimeout:
        log.seek(0)
        pytest.fail(
            f"the panel's run did not finish: {box.inner_text()[-2000:]}\nJupyterLab's log:\n{log.read()[-2000:]}"
        )
    shown = page.evaluate(
        "(run) => ({head: run.firstElementChild.textContent.trim(), columns: Array.from("
        "run.children[1].children).map(c => ({title: c.querySelector('b').textContent, "
        "lines: c.querySelector('pre').innerText.split('\\n').filter(l => l.trim())}))})",
        box.locator(".lessonlib-run").element_handle(),
    )
    # A run that stalls, stopped with the Stop button while the kernel is idle.
    stall = box.locator(".widget-inline-hbox", has_text="--stall-rank").locator("input")
    stall.fill("1")
    stall.press("Enter")
    box.locator("button", has_text="Run").click()
    page.wait_for_function(
        "(el) => /busy for/.test(el.textContent)", arg=box.element_handle(), timeout=LAB_TIMEOUT * 1000
    )
    box.locator("button", has_text="Stop").click()
    page.wait_for_function("(el) => /stopped:/.test(el.textContent)", arg=box.element_handle(), timeout=60_000)
    shown["stopped"] = box.inner_text()
    page.locator(".lessonlib-panel").last.scroll_into_view_if_needed()
    page.screenshot(path=SCREENSHOTS / "jupyterlab_run_panel.png")
    return shown


def test_every_chapter_offers_its_notebook_for_download(book_html):
    """The theme's download button links each chapter's page to its notebook, and the file is there."""
    missing = []
    for notebook in tracked_notebooks():
        page = (book_html / f"{notebook.stem}.html").read_text()
        source = book_html / "_sources" / notebook.name
        if f'href="_sources/{notebook.name}"' not in page or not source.exists():
            missing.append(notebook.name)
        else:
            assert json.loads(source.read_text())["cells"], f"{source} holds no cells"
    assert not missing, f"chapters without a notebook to download: {missing}"
