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
