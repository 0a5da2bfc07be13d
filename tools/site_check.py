"""Check the built site in headless Chromium: every page renders without a JavaScript error, no internal link, anchor or
image is broken, the navigation lists the notebooks in the lesson order, and search finds a known word.

Usage: python tools/site_check.py SITE_DIR --root REPO [--search WORD]. The site is served from a local HTTP server on a
free port; requests to other hosts are refused (the check needs no network). Prints each problem on one line and exits
1 if there is any."""
import argparse, functools, http.server, importlib.util, os, shutil, sys, threading, time
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--no-first-run"]
# what each page reports: the ids it defines, its links (resolved by the browser) and whether each image loaded
PAGE_FACTS = """() => ({
  ids: [...document.querySelectorAll('[id]')].map(e => e.id).concat(
       [...document.querySelectorAll('a[name]')].map(e => e.name)),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  images: [...document.querySelectorAll('img')].map(i => ({src: i.currentSrc || i.src,
                                                          ok: i.complete && i.naturalWidth > 0})),
  nav: [...document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]')].map(a => a.href),
})"""


def find_browser():
    "A Chromium executable: $MMRGRPO_CHROMIUM, else the first of `BROWSERS` on the PATH."
    exe = os.environ.get("MMRGRPO_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    return exe if exe and os.access(exe, os.X_OK) else None


def site_hooks(root: Path):
    "The site's own hooks module (docs/site_hooks.py), for the lesson order the navigation must follow."
    spec = importlib.util.spec_from_file_location("site_hooks", root / "docs" / "site_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_nav(root: Path) -> list:
    "Site paths of the notebooks' pages in the lesson order (index.html first)."
    nbs = root / "nbs"
    return ["index.html" if p == nbs / "index.ipynb" else p.relative_to(root).with_suffix(".html").as_posix()
            for p in site_hooks(root).lesson_order(nbs)]


def order_problems(nav: list, expected: list) -> list:
    "What is wrong with the navigation's notebook pages (`nav`, in order) against the lesson order."
    pages = [p for p in dict.fromkeys(nav) if p in set(expected) or p.startswith("nbs/")]
    missing = [p for p in expected if p not in pages]
    if missing: return [f"navigation: missing {missing}"]
    return [] if pages == expected else [f"navigation: notebooks in the order {pages}, the lesson order is {expected}"]


def serve(site: Path):
    "A quiet HTTP server for `site` on a free local port, in a thread."
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args): pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def local_path(site: Path, url: str, base: str):
    "The site file a URL of the local server names (a folder's index.html), or None for another host."
    if not url.startswith(base): return None
    path = unquote(urlparse(url).path).lstrip("/")
    return site / path / "index.html" if not path or path.endswith("/") else site / path


def visit(tab, base: str, pages: list) -> tuple:
    "Load every page in the browser: what each page reports (PAGE_FACTS), and its errors, failed loads and images."
    facts, problems, errors = {}, [], []
    tab.on("pageerror", lambda e: errors.append(f"JavaScript error: {e}"))
    # a failed load is reported with its URL (images by the image check), not as the console's line about it
    tab.on("console", lambda m: errors.append(f"console error: {m.text}")
           if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
    tab.on("response", lambda r: errors.append(f"{r.url[len(base):]}: HTTP {r.status}")
           if r.url.startswith(base) and r.status >= 400 and r.request.resource_type != "image" else None)
    for rel in pages:
        errors.clear()
        response = tab.goto(base + rel, wait_until="load")
        if not response or not response.ok: problems.append(f"{rel}: HTTP {response and response.status}")
        facts[rel] = tab.evaluate(PAGE_FACTS)
        problems += [f"{rel}: {e}" for e in errors]
        problems += [f"{rel}: image {i['src'][:120]} did not load" for i in facts[rel]["images"]
                     if not i["ok"] and i["src"].startswith((base, "data:"))]
    return facts, problems


def link_problems(site: Path, base: str, facts: dict) -> list:
    "Links to the site's own files that name no file, or an anchor that the page they name does not have."
    problems = []
    for rel, f in facts.items():
        for link in f["links"]:
            url, anchor = urldefrag(link)
            target = local_path(site, url, base)
            if target is None: continue
            if not target.is_file(): problems.append(f"{rel}: broken link {link[len(base):]}")
            elif anchor and target.suffix == ".html":
                ids = facts.get(target.relative_to(site).as_posix(), {}).get("ids", [])
                if unquote(anchor) not in ids: problems.append(f"{rel}: broken anchor {link[len(base):]}")
    return problems


def check(site: Path, root: Path, word: str) -> list:
    "Every problem the browser finds on the site in `site`, built from the repository `root`."
    from playwright.sync_api import sync_playwright
    exe = find_browser()
    if not exe: return ["no Chromium found: run tools/install_browser.sh, or set MMRGRPO_CHROMIUM to one"]
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=exe, args=ARGS)
            context = browser.new_context()
            context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base)
                          else route.abort())   # no network: other hosts' scripts and images are refused
            tab = context.new_page()
            facts, problems = visit(tab, base, pages)
            problems += link_problems(site, base, facts)
            nav = [local_path(site, urldefrag(u)[0], base) for u in facts.get("index.html", {}).get("nav", [])]
            problems += order_problems([p.relative_to(site).as_posix() for p in nav if p], expected_nav(root))
            problems += search_problems(tab, base, word)
            browser.close()
    finally:
        server.shutdown()
    print(f"site_check: {len(pages)} pages, {sum(len(f['links']) for f in facts.values())} links, "
          f"{sum(len(f['images']) for f in facts.values())} images checked")
    return list(dict.fromkeys(problems))   # a link repeated on a page is one problem


def search_problems(tab, base: str, word: str) -> list:
    "Type `word` into the site's search box on the home page; at least one result must come back."
    tab.goto(base + "index.html", wait_until="load")
    tab.locator("input.md-search__input").click()
    tab.keyboard.type(word)
    try: tab.wait_for_selector(".md-search-result__item", timeout=20_000)
    except Exception: return [f"search: no result for {word!r}"]
    hits = tab.eval_on_selector_all(".md-search-result__item a", "as => as.map(a => a.href)")
    print(f"site_check: search for {word!r}: {len(hits)} results, first {hits[0][len(base):] if hits else None}")
    return [] if hits else [f"search: no result for {word!r}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the built site's folder")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the repository")
    parser.add_argument("--search", default="advantages", help="a word the site's search must find")
    args = parser.parse_args()
    start = time.monotonic()
    problems = check(args.site.resolve(), args.root.resolve(), args.search)
    for p in problems: print(f"site_check: {p}")
    print(f"site_check: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'passed'} "
          f"in {time.monotonic() - start:.1f} s")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
