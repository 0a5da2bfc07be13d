"""The lessons form one story: read in file-name order, a notebook imports only modules that an earlier notebook (or
itself) has built, and so does each package module. Also: every module is built by exactly one notebook, and the
README's table of notebooks lists every notebook in file-name order with the module it builds."""
import ast, json, re
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
MODULES = sorted(p.stem for p in (ROOT / "mmrgrpo").glob("*.py") if not p.stem.startswith("_"))
# `mmrgrpo.<module>` anywhere in code (an import, importlib, a string naming a reward function or a backend)
NAMED = re.compile(r"\bmmrgrpo\.(\w+)")
FROM_PACKAGE = re.compile(r"^\s*from\s+mmrgrpo\s+import\s+\(?([\w ,]+)", re.M)


def lesson_order() -> list:
    "Every notebook, in reading order: nbs/*.ipynb by file name (index.ipynb is the README), then nbs/tutorials/."
    return ([p for p in sorted(NBS.glob("*.ipynb")) if p.name != "index.ipynb"]
            + sorted((NBS / "tutorials").glob("*.ipynb")))


def code_cells(path: Path) -> list:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def built_module(cells: list):
    "The module a notebook exports to (`#| default_exp`), or None for a lesson without one."
    found = [m.group(1) for src in cells for m in re.finditer(r"^#\|\s*default_exp\s+(\S+)", src, re.M)]
    return found[0] if found else None


def used_modules(source: str) -> set:
    "Package modules that a piece of code refers to: `mmrgrpo.x` (imports, strings) and `from mmrgrpo import x`."
    names = {m.group(1) for m in NAMED.finditer(source)}
    for m in FROM_PACKAGE.finditer(source): names |= {n.strip() for n in m.group(1).split(",")}
    return names & set(MODULES)


def relative_imports(path: Path) -> set:
    "Package modules a module imports (`from .x import`, `from mmrgrpo.x import`, `import mmrgrpo.x`), at any depth."
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module: out.add(node.module.split(".")[0])
            elif node.level == 1: out |= {a.name for a in node.names}
            elif node.module and node.module.startswith("mmrgrpo."): out.add(node.module.split(".")[1])
            elif node.module == "mmrgrpo": out |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mmrgrpo.")}
    return out & set(MODULES)


def forward_references(order: list) -> list:
    """(notebook, module) for each module that a notebook uses before the notebook that builds it, in `order`: a list of
    (name, module it builds or None, modules it uses)."""
    built, bad = set(), []
    for name, module, uses in order:
        if module: built.add(module)
        bad += [(name, u) for u in sorted(uses - built)]
    return bad


def story() -> list:
    return [(p.relative_to(NBS).as_posix(), built_module(cells), set().union(*map(used_modules, cells)))
            for p in lesson_order() for cells in [code_cells(p)]]


def test_every_module_is_built_by_exactly_one_notebook():
    built = [m for _, m, _ in story() if m]
    assert sorted(built) == MODULES, (sorted(set(MODULES) - set(built)), [m for m in built if built.count(m) > 1])


def test_notebooks_import_only_what_earlier_notebooks_built():
    assert forward_references(story()) == []


def test_modules_import_only_modules_of_earlier_notebooks():
    rank = {m: i for i, (_, m, _) in enumerate(story()) if m}
    late = [(m, dep) for m in MODULES for dep in sorted(relative_imports(ROOT / "mmrgrpo" / f"{m}.py"))
            if rank[dep] > rank[m]]
    assert late == []


def test_the_checks_catch_a_forward_reference():
    "The checker itself: a lesson that uses a module built later is reported, the same lessons in order are not."
    a, b = ("10_a.ipynb", "a", set()), ("11_b.ipynb", "b", {"a"})
    assert forward_references([a, b]) == []
    assert forward_references([b, a]) == [("11_b.ipynb", "a")]
    assert (used_modules('x = "mmrgrpo.sampling:HFBackend"\nfrom mmrgrpo import config, nothing_real')
            == {"sampling", "config"})
    assert "mmrgrpo.github" not in used_modules("see https://mmrgrpo.github.io/mmrgrpo/")


def test_readme_table_lists_the_notebooks_in_order():
    "The README's table of notebooks: every notebook once, in file-name order, with the module it builds."
    readme = (ROOT / "README.md").read_text()
    readme = readme[readme.index("## The notebooks"):]
    readme = readme[:readme.index("\n## ", 5)]
    rows = re.findall(r"^\| `([\w/]+)` \| ([^|]*)\|", readme, re.M)
    expected = [(p.relative_to(NBS).with_suffix("").as_posix(), m) for p, (_, m, _) in zip(lesson_order(), story())]
    assert [r[0] for r in rows] == [e[0] for e in expected]
    for (name, cell), (_, module) in zip(rows, expected):
        assert (f"`mmrgrpo.{module}`" in cell) if module else ("mmrgrpo." not in cell), (name, cell, module)


def long_without_reason(lines: list, limit: int) -> bool:
    """More than `limit` lines, and no comment among the first three that says why (it names its length:
    '... lines ...')."""
    return len(lines) > limit and not any(l.lstrip().startswith("#") and "lines" in l for l in lines[:3])


def test_no_code_cell_over_60_lines_without_a_reason():
    long = [(p.relative_to(NBS).as_posix(), i, len(src.splitlines())) for p in lesson_order()
            for i, src in enumerate(code_cells(p)) if long_without_reason(src.splitlines(), 60)]
    assert long == []


def test_no_function_over_50_lines_without_a_reason():
    long = []
    for m in MODULES:
        text = (ROOT / "mmrgrpo" / f"{m}.py").read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(text))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = text[node.lineno - 1:node.end_lineno]
                if long_without_reason(body[1:], 49): long.append((m, node.name, len(body)))
    assert long == []


def test_the_length_rule_can_fail():
    assert long_without_reason(["x = 1"] * 61, 60)
    assert not long_without_reason(["# 70 lines: a dataclass cannot be split"] + ["x = 1"] * 69, 60)
    assert not long_without_reason(["x = 1"] * 60, 60)


def test_every_notebook_opens_with_a_summary():
    "Each notebook's first markdown cell has a title and a `> summary` line that says what the learner will see."
    missing = []
    for p in lesson_order() + [NBS / "index.ipynb"]:
        cells = json.loads(p.read_text())["cells"]
        first = next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")
        summary = re.search(r"^> (.+)$", first, re.M)
        if not (first.startswith("# ") and summary and len(summary.group(1).split()) >= 5): missing.append(p.name)
    assert missing == []


# the appendix after the command line: CPU speed (a KV cache with room, the sampling copy and its fused decoder, the
# fast update and its attention and bf16 parts), the reward's worker processes, and vLLM
SPEED_AND_SCALE = {"kvcache", "sampler_copy", "fused_decode", "fast_update", "matmul_attention", "bf16_update",
                   "verifier_pool", "vllm_backend"}


def test_the_speed_part_comes_after_the_trainer_and_the_cli():
    """The main path reads plain GRPO -> the methods -> the trainer -> the CLI; every appendix notebook comes after them
    all."""
    order = story()
    last_main = max(i for i, (_, m, _) in enumerate(order) if m in ("trainer", "cli"))
    early = [name for name, m, _ in order[:last_main] if m in SPEED_AND_SCALE]
    assert early == [], early
    assert {m for _, m, _ in order} >= SPEED_AND_SCALE       # each is still built, after the main path


def test_the_main_path_uses_no_appendix_module():
    "No main-path module imports one of the appendix's (the trainer finds those as speed-ups, `40b_speedups`)."
    order = story()
    main = {m for _, m, _ in order if m and m not in SPEED_AND_SCALE}
    used = [(m, dep) for m in sorted(main) for dep in relative_imports(ROOT / "mmrgrpo" / f"{m}.py") & SPEED_AND_SCALE]
    assert used == []


def test_the_path_opens_with_a_grpo_step():
    """The first lesson takes a whole GRPO step, and builds and uses no module of the package, so nothing has to come
    before it."""
    assert story()[0] == ("01_grpo_step.ipynb", None, set())


# GRPO's core (advantages, loss, log-probs) comes right after 01, before the parts a run loads around it
CORE = ("advantages", "loss", "logprobs")


def test_the_core_comes_before_the_parts():
    "The notebooks building the core modules are lessons 2-4, before the one building `safety` (the parts start there)."
    built = [m for _, m, _ in story()]
    assert [built.index(m) for m in CORE] == [1, 2, 3], [name for name, _, _ in story()[:5]]
    assert built.index("logprobs") < built.index("safety")


SKIP_MARK = "Skip on first reading"


NAME = r"`\d+[a-z]?_\w+`"


def fast_track(readme: str) -> list:
    "The notebooks of the first chain `a` -> `b` -> ... under the README's `### Fast track` heading ([] if none)."
    m = re.search(r"^### Fast track\n(.*?)(?=^#)", readme + "\n#", re.M | re.S)
    chain = re.search(rf"{NAME}(?:\s*(?:->|→)\s*{NAME})+", m.group(1)) if m else None
    return re.findall(r"`(\d+[a-z]?_\w+)`", chain.group(0)) if chain else []


def markdown_cells(path: Path) -> list:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def main_path() -> list:
    "The lessons before the first one that builds an appendix module (name without `.ipynb`)."
    order = story()
    first = next(i for i, (_, m, _) in enumerate(order) if m in SPEED_AND_SCALE)
    return [name.removesuffix(".ipynb") for name, _, _ in order[:first]]


def fast_track_problems(track: list, path: list, opening: dict) -> list:
    """What is wrong with a fast track: a name that is no lesson, lessons out of order, a start after the first lesson,
    a skipped lesson of the main `path` (between two consecutive fast-track lessons) whose `opening` (its first two
    markdown cells) does not say SKIP_MARK."""
    bad = [f"no such lesson: {n}" for n in track if n not in path]
    track = [n for n in track if n in path]
    if track != sorted(track, key=path.index): bad.append(f"not in lesson order: {track}")
    if track[:1] != path[:1]: bad.append(f"does not start with the first lesson {path[:1]}: {track[:1]}")
    for a, b in zip(track, track[1:]):
        bad += [f"{n} is skipped and does not say {SKIP_MARK!r}"
                for n in path[path.index(a) + 1:path.index(b)] if SKIP_MARK not in "\n".join(opening[n][:2])]
    return bad


def test_the_fast_track_is_checked():
    "The checker: a track in order with its skipped lessons marked passes; a missing, unordered or unmarked one fails."
    path = ["01_a", "02_b", "03_c", "09_d", "19_e"]
    opening = {n: ["# t", "text"] for n in path} | {"09_d": ["# t", f"> **{SKIP_MARK}** (...)"]}
    track = ["01_a", "03_c", "19_e"]
    assert fast_track_problems(track, path, opening | {"02_b": ["# t", f"> {SKIP_MARK}"]}) == []
    assert fast_track_problems(track, path, opening) == [f"02_b is skipped and does not say {SKIP_MARK!r}"]
    assert fast_track_problems(["03_c", "01_a", "09_d"], path, opening)[:2] == [
        "not in lesson order: ['03_c', '01_a', '09_d']", "does not start with the first lesson ['01_a']: ['03_c']"]
    assert fast_track_problems(["01_a", "02_b", "07_x"], path, opening) == ["no such lesson: 07_x"]
    readme = ("## N\n\n### Fast track\n`01_a` -> `03_c` ->\n`19_e`, then the demo; second reading: `02_b`.\n\n"
              "### Next\n`09_d`")
    assert fast_track(readme) == track and fast_track("## N\n`01_a` -> `03_c`") == []


# Places of today's lessons that the fast-track check reports, each with who fixes it: cleared at the merge of issue 57
def test_the_fast_track_is_marked():
    "The README's fast track names lessons in order from 01_grpo_step; each lesson it skips says so at its top."
    track = fast_track((ROOT / "README.md").read_text())
    assert track, "README.md: no `### Fast track` paragraph naming notebooks"
    assert track[0] == "01_grpo_step"
    opening = {n: markdown_cells(NBS / f"{n}.ipynb") for n in main_path()}
    assert fast_track_problems(track, main_path(), opening) == []


# Appendix features a main-path lesson may not lean on: the notebook building each -> what names it (any case)
APPENDIX_IDEAS = {
    "60_kvcache": ("cache_room", "reserve_cache", "ReservedLayer", "room reserved", "reserves room", "kv cache room"),
    "61_sampler_copy": ("merged copy", "sampling copy", "CopyBackend", "sampler_dtype"),
    "61a_fused_decode": ("fused decoder", "fused_decode", "FusedBackend"),
    "62_fast_update": ("fast update", "fused_head", "pack_completions", "packed pass", "KeptHeap", "mallopt"),
    "62a_matmul_attention": ("matmul attention", "update_attention", "MatmulAttention"),
    "62b_bf16_update": ("bf16 base", "bf16_base", "base bfloat16", "BaseLinear16", "bf16_update"),
    "64_vllm": ("vllm",),
}   # not 63_verifier_pool: the worker pool's code is 10_rewards' own, 63 only walks through it
REGISTRY = "40b_speedups"      # from here on, a main-path output may name a speed-up next to a link that explains it
EXEMPT = {"40b_speedups": "it lists the speed-ups it finds installed",
          "46_config_reference": "every config field, generated from the dataclass"}
SIDE = re.compile(r"^(#{2,6}) (?:Under the hood|Side trip):", re.M)
HEADING = re.compile(r"^(#{1,6}) ", re.M)


def appendix_named(text: str) -> list:
    "The appendix notebooks whose features (or whose own names) `text` names."
    low = text.lower()
    return [nb for nb, words in APPENDIX_IDEAS.items() if any(w.lower() in low for w in (nb,) + words)]


def side_flags(cells: list) -> list:
    "For each cell, whether it lies in an `Under the hood:`/`Side trip:` section (until a heading of its level or up)."
    side_level, out = None, []
    for c in cells:
        if c["cell_type"] == "markdown":
            for m in HEADING.finditer("".join(c["source"])):
                level = len(m.group(1))
                if side_level is not None and level <= side_level: side_level = None
                if side_level is None and SIDE.match("".join(c["source"])[m.start():]): side_level = level
        out.append(side_level is not None)
    return out


def appendix_problems(cells: list, after_registry: bool) -> list:
    """(cell index, cell id, what it names) for each place of a main-path lesson that leans on the appendix: before the
    registry a markdown cell or an output outside a side section; from it on an output with no neighbouring markdown
    cell (the nearest before or after) that links 40b_speedups or the notebook of the feature."""
    from test_prose import output_text
    side, bad = side_flags(cells), []
    for i, c in enumerate(cells):
        text = "".join(c["source"]) if c["cell_type"] == "markdown" else output_text(c)
        named = appendix_named(text)
        if not named or side[i]: continue
        if not after_registry:
            bad.append((i, c.get("id"), named)); continue
        if c["cell_type"] == "markdown": continue
        near = [next(("".join(d["source"]) for d in seq if d["cell_type"] == "markdown"), "")
                for seq in (cells[i - 1::-1] if i else [], cells[i + 1:])]
        links = [nb for nb in [REGISTRY] + named if any(f"{nb}.ipynb" in n for n in near)]
        if REGISTRY not in links and set(named) - set(links): bad.append((i, c.get("id"), named))
    return bad


# Places on the main path that name an appendix feature today: notebook -> cells; each owner fixes and deletes its line
KNOWN_APPENDIX = {}     # notebook -> the cells still to move (strict xfail); empty: the main path is clean


def _appendix_param(name: str):
    marks = ([pytest.mark.xfail(strict=True, reason=f"appendix ideas to move: {KNOWN_APPENDIX[name]}")]
             if name in KNOWN_APPENDIX else [])
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_appendix_param(n) for n in main_path() if n not in EXEMPT])
def test_no_appendix_idea_on_the_main_path(name):
    path = main_path()
    cells = json.loads((NBS / f"{name}.ipynb").read_text())["cells"]
    assert appendix_problems(cells, path.index(name) > path.index(REGISTRY)) == []


def test_an_appendix_idea_on_the_main_path_is_found():
    "A planted output naming the fused decoder in 19_one_step is reported; the same under a `### Side trip:` is not."
    cells = json.loads((NBS / "19_one_step.ipynb").read_text())["cells"]
    assert appendix_problems(cells, False) == []
    planted = {"cell_type": "code", "id": "planted", "source": ["print(line)"], "outputs": [{
        "output_type": "stream", "name": "stdout",
        "text": ["sampling from a merged copy in bfloat16 (fused decoder)\n"]}]}
    found = appendix_problems(cells + [planted], False)
    assert found == [(len(cells), "planted", ["61_sampler_copy", "61a_fused_decode"])], found
    side = {"cell_type": "markdown", "id": "s", "source": ["### Side trip: the appendix's sampler"]}
    assert appendix_problems(cells + [side, planted], False) == []
    back = {"cell_type": "markdown", "id": "b", "source": ["## Back on the main path"]}
    assert appendix_problems(cells + [side, back, planted], False) != []
    linked = {"cell_type": "markdown", "id": "l", "source": ["[40b_speedups](40b_speedups.ipynb) lists them."]}
    assert appendix_problems(cells + [planted, linked], True) == []
    assert appendix_problems(cells + [planted], True) != []
