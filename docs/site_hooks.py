"""mkdocs hooks that make the site from the repository as it is: nbs/index.ipynb as the home page, every notebook in
reading order, then the top-level Markdown pages (ALGORITHMS.md, BENCHMARKS.md, ...), each at its own path, so relative
links resolve on the site as they do on GitHub. Links to files the site does not carry go to the file on GitHub."""
import posixpath, re
from pathlib import Path
from urllib.parse import unquote

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

IMAGES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
LINK = re.compile(r'\]\(<?([^)\s>]+)>?[^)]*\)|\b(?:href|src)="([^"]+)"')   # a Markdown or HTML link's target
ATTR = re.compile(r'\b(href|src)="([^"]*)"')


def repo_root(config) -> Path:
    "The repository: the folder above the one holding mkdocs.yml."
    return Path(config.config_file_path).resolve().parent.parent


def hidden(path: Path) -> bool:
    return any(part.startswith((".", "_")) for part in path.parts)


def lesson_order(nbs: Path) -> list:
    "Every notebook in reading order: index.ipynb, the top-level ones by name, then each folder's (tutorials/ last)."
    top = sorted(p for p in nbs.glob("*.ipynb") if p.name != "index.ipynb")
    folders = sorted((d for d in nbs.iterdir() if d.is_dir() and not hidden(d.relative_to(nbs))),
                     key=lambda d: (d.name == "tutorials", d.name))
    inner = [p for d in folders for p in sorted(d.rglob("*.ipynb")) if not hidden(p.relative_to(nbs))]
    return [p for p in [nbs / "index.ipynb"] if p.exists()] + top + inner


def title(path: Path) -> str:
    "A page's first level-1 heading, else its file name."
    if path.suffix == ".ipynb":
        import json
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else: text = path.read_text()
    m = re.search(r"^# (.+)$", text, re.M)
    return m.group(1).strip() if m else path.stem


def nav_label(path: Path) -> str:
    "A lesson's number and title in the navigation: `04 Log-probs in bounded memory`."
    number = re.match(r"^(\d+[a-z]?)_", path.stem)
    return f"{number.group(1)} {title(path)}" if number else title(path)


def site_pages(root: Path) -> list:
    "(source URI on the site, file) of every page in navigation order; the home page is `index.ipynb` at the top."
    nbs = root / "nbs"
    pages = [("index.ipynb" if p == nbs / "index.ipynb" else p.relative_to(root).as_posix(), p)
             for p in lesson_order(nbs)]
    return pages + [(p.name, p) for p in sorted(root.glob("*.md")) if p.name != "README.md"]


# the parts of the lesson order: (first lesson number of the part, its name in the navigation)
PARTS = ((1, "1. GRPO's core"), (9, "2. The parts of a step"), (20, "3. The methods"), (40, "4. The trainer"),
         (60, "Appendix: speed and scale"))


def part_of(stem: str, parts=PARTS) -> str:
    "The part a top-level lesson belongs to, by its leading number (`20a_diversity` is in 20's part)."
    number = re.match(r"^(\d+)", stem)
    names = [name for first, name in parts if number and int(number.group(1)) >= first]
    return names[-1] if names else "Lessons"


def on_config(config):
    root = repo_root(config)
    pages = site_pages(root)
    lessons = [p for p in pages if p[1].suffix == ".ipynb" and p[0] != "index.ipynb"]
    nav = [{"Home": "index.ipynb"}] if pages and pages[0][0] == "index.ipynb" else []
    sections = {}
    for uri, path in lessons:
        folder = path.parent.relative_to(root / "nbs").as_posix()
        sections.setdefault(part_of(path.stem) if folder == "." else folder.replace("_", " ").capitalize(), []).append(
            {nav_label(path): uri})
    nav += [{name: items} for name, items in sections.items()]
    reference = [{path.name: uri} for uri, path in pages if path.suffix == ".md"]   # named as the lessons cite them
    config.nav = nav + ([{"Reference": reference}] if reference else [])
    return config


def linked_images(root: Path, uri: str, path: Path) -> set:
    "Repository images (as paths from the root) that a page links to: they are copied onto the site."
    found = set()
    for m in LINK.finditer(path.read_text()):
        target = unquote((m.group(1) or m.group(2)).split("#")[0])
        if not target or "://" in target or target.startswith(("/", "data:", "mailto:")): continue
        rel = posixpath.normpath(posixpath.join(posixpath.dirname(uri), target))
        if Path(rel).suffix.lower() in IMAGES and (root / rel).is_file(): found.add(rel)
    return found


@event_priority(100)   # before mkdocs-jupyter's own on_files, which wraps the notebooks it finds here
def on_files(files, config):
    root = repo_root(config)
    out = [f for f in files if f.src_dir != config.docs_dir]   # the theme's assets; the walk of docs_dir is dropped
    images = set()
    for uri, path in site_pages(root):
        src_dir = path.parent if uri == "index.ipynb" else root
        out.append(File(uri, str(src_dir), config.site_dir, config.use_directory_urls))
        images |= linked_images(root, uri, path)
    images |= {p.relative_to(root).as_posix() for p in (root / "nbs").rglob("*")
               if p.suffix.lower() in IMAGES and not hidden(p.relative_to(root))}
    out += [File(rel, str(root), config.site_dir, config.use_directory_urls) for rel in sorted(images)]
    here = str(Path(config.config_file_path).parent)
    out += [File(str(css), here, config.site_dir, config.use_directory_urls) for css in config.extra_css]
    return Files(out)


HEADING = re.compile(r'<h([1-6])([^>]*?) id="([^"]*)"([^>]*)>(.*?)</h\1>', re.S)


def unique_headings(html: str) -> tuple:
    "`html` with unique heading ids (`_1`, `_2` as on Markdown pages), and its table of contents read from them."
    seen, tokens, stack = {}, [], []
    def fix(m):
        level, before, hid, after, inner = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
        n = seen.get(hid, 0)
        seen[hid] = n + 1
        new = f"{hid}_{n}" if n else hid
        inner = inner.replace(f'href="#{hid}"', f'href="#{new}"')
        name = re.sub(r"<[^>]+>", "", inner).replace("\u00b6", "").strip()
        token = {"level": level, "id": new, "name": name, "children": []}
        while stack and stack[-1]["level"] >= level: stack.pop()
        (stack[-1]["children"] if stack else tokens).append(token)
        stack.append(token)
        return f'<h{level}{before} id="{new}"{after}>{inner}</h{level}>'
    return HEADING.sub(fix, html), tokens


def on_page_content(html, page, config, files):
    "Links between pages point at their pages, links to other repository files at GitHub, the rest stays as written."
    if page.file.src_uri.endswith(".ipynb"):
        from mkdocs.structure.toc import get_toc
        html, tokens = unique_headings(html)
        page.toc = get_toc(tokens)
    root, uri = repo_root(config), page.file.src_uri
    blob = config.repo_url.rstrip("/") + "/blob/main/"
    def rewrite(m):
        attr, target = m.group(1), m.group(2)
        if not target or "://" in target or target.startswith(("#", "/", "data:", "mailto:")): return m.group(0)
        path, _, anchor = target.partition("#")
        rel = posixpath.normpath(posixpath.join(posixpath.dirname(uri), unquote(path)))
        anchor = "#" + anchor if anchor else ""
        if rel in files.src_uris: return f'{attr}="{files.src_uris[rel].url_relative_to(page.file)}{anchor}"'
        if not rel.startswith("..") and (root / rel).exists():
            return f'{attr}="{blob.replace("/blob/", "/tree/") if (root / rel).is_dir() else blob}{rel}{anchor}"'
        return m.group(0)
    return ATTR.sub(rewrite, html)
