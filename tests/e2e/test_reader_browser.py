"""The reader's site in a real browser: headless Chromium (Debian's `chromium`; `apt-get install -y chromium`)
loads every page from `python -m http.server`'s handler, with no console error, no failed load and no
uncaught exception; every file of the reading table and every cited section is on screen once the
collapsed parts are opened; a screenshot of each page is taken, and one of nano_flashattn's forward kernel
with FlashAttention-2's Algorithm 1, lines 6-11 beside it. Skipped, saying why, where no Chromium is found.
"""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cdp_pipe import Browser, find_chromium

from shared.reader import build_site, maps

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = find_chromium()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium found (/usr/bin/chromium: Debian's `apt-get install -y chromium`, "
                             "or set CHROMIUM=/path/to/chrome)")]


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    site = tmp_path_factory.mktemp("reader") / "site"
    build_site(site, ROOT)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    browser = Browser(CHROMIUM)
    try:
        yield f"http://127.0.0.1:{server.server_port}", browser, site
    finally:
        browser.close()
        server.shutdown()
        thread.join()


def test_every_page_renders_without_errors_and_shows_its_files_and_citations(served, tmp_path):
    base, browser, site = served
    pages = sorted(p.name for p in site.glob("*.html"))
    for name in pages:
        browser.goto(f"{base}/{name}")
        assert browser.errors() == [], f"{name}: errors in the browser"
        assert browser.eval("document.styleSheets.length") == 1
        assert browser.eval("Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)"), name
        browser.screenshot(tmp_path / f"{name}.png")
    for package in maps.paper_path_packages(ROOT):
        browser.goto(f"{base}/{package}.html")
        text = browser.eval("document.body.innerText")
        for row in maps.reading_rows(package, ROOT):
            assert row.name in text, f"{package}: {row.name} is not on screen"
        browser.eval("document.querySelectorAll('details').forEach(d => d.open = true)")
        hidden = browser.eval("Array.from(document.querySelectorAll('a.cite')).filter(a => "
                              "!a.getClientRects().length || !a.href.startsWith('https://arxiv.org/abs/'))"
                              ".map(a => a.textContent)")
        assert hidden == [], f"{package}: citations not shown, or not to arXiv: {hidden[:10]}"
        assert browser.eval("document.querySelectorAll('a.cite').length") > 0


def test_a_link_into_a_collapsed_layer_opens_it(served):
    base, browser, _ = served
    browser.goto(f"{base}/nano_flashattn.html#layers/hopper.py")
    assert browser.eval("document.getElementById('layers/hopper.py').open")


def test_screenshot_of_algorithm_1_beside_the_forward_kernel(served, tmp_path):
    base, browser, _ = served
    browser.goto(f"{base}/nano_flashattn.html")
    block = "document.getElementById('nano_flashattn.forward.fwd_tiles').closest('.block')"
    browser.eval(f"{block}.scrollIntoView()")
    # on screen, side by side: the docstring's "Algorithm 1, lines 6-11" and the loop over key tiles
    cite = browser.eval(f"(() => {{ const a = {block}.querySelector('.prose a.cite'); "
                        "const r = a.getBoundingClientRect(); return [a.textContent, r.left, r.top]; })()")
    loop = browser.eval("(() => { const r = document.getElementById('forward.py-L102').getBoundingClientRect();"
                        " return [r.left, r.top, r.bottom <= innerHeight]; })()")
    assert cite[0] == "Algorithm 1, lines 6-11" and 0 <= cite[2] < 100
    assert loop[0] > cite[1] + 300 and loop[2], "the kernel's loop is not beside the prose, on screen"
    shot = browser.screenshot(tmp_path / "reader_nano_flashattn.png")
    assert shot.stat().st_size > 20_000
