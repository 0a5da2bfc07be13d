"""The lessons' website (docs/mkdocs.yml, tools/site.sh): its pages in the lesson order, and a browser check that passes
on a clean site and fails on a broken link, anchor or image planted in a notebook. The browser tests build a small site
(two lessons copied from nbs/, a home page) under the test's temporary folder. Skipped, with the reason, where mkdocs
or a Chromium is missing (`pip install -e ".[dev]"`, `tools/install_browser.sh`)."""
import importlib.util, json, re, shutil, subprocess, sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import site_check  # noqa: E402
sys.path.insert(0, str(ROOT / "tests"))
from test_lesson_order import lesson_order  # noqa: E402

NBS = ROOT / "nbs"
LESSONS = ["02_advantages.ipynb", "03_loss.ipynb"]   # small lessons whose only links go to ALGORITHMS.md


def notebook(*markdown: str) -> dict:
    cells = [{"cell_type": "markdown", "id": f"c{i}", "metadata": {}, "source": s} for i, s in enumerate(markdown)]
    return {"cells": cells,
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


def write(path: Path, nb: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb, indent=1))


def mini_repo(tmp_path: Path) -> Path:
    "A repository of two lessons copied from nbs/, a home page linking to them, ALGORITHMS.md and the site's config."
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", repo / "docs")
    shutil.copy(ROOT / "ALGORITHMS.md", repo / "ALGORITHMS.md")
    for name in LESSONS: write(repo / "nbs" / name, json.loads((NBS / name).read_text()))
    shutil.copytree(ROOT / "configs", repo / "configs")
    write(repo / "nbs" / "index.ipynb", notebook("# mini\n\nStart with [advantages](nbs/02_advantages.ipynb); "
                                                 "the formulas: [ALGORITHMS.md](ALGORITHMS.md); the demo's "
                                                 "[config](configs/demo.yaml)."))
    return repo



def site_sh(repo: Path) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocs_jupyter") is None:
        pytest.skip('mkdocs or mkdocs-jupyter missing: pip install -e ".[dev]"')
    if site_check.find_browser() is None: pytest.skip("no Chromium: run tools/install_browser.sh")
    return subprocess.run(["bash", str(ROOT / "tools" / "site.sh"), str(repo)], capture_output=True, text=True,
                          timeout=300)


def test_the_site_follows_the_lesson_order():
    "The site's pages: the home page, then every notebook in the order the lesson-order test reads them."
    hooks = site_check.site_hooks(ROOT)
    assert hooks.lesson_order(NBS) == [NBS / "index.ipynb"] + lesson_order()


def test_the_order_comes_from_file_names_and_folders(tmp_path):
    "Numbers sort lessons, folders follow the top-level lessons, tutorials/ comes last; hidden folders are left out."
    for name in ["tutorials/t.ipynb", "b_part/02_y.ipynb", "b_part/01_x.ipynb", "10_b.ipynb", "01_a.ipynb",
                 "index.ipynb", ".ipynb_checkpoints/01_a-checkpoint.ipynb", "a_part/5_z.ipynb"]:
        write(tmp_path / name, notebook("# t"))
    order = [p.relative_to(tmp_path).as_posix() for p in site_check.site_hooks(ROOT).lesson_order(tmp_path)]
    assert order == ["index.ipynb", "01_a.ipynb", "10_b.ipynb", "a_part/5_z.ipynb", "b_part/01_x.ipynb",
                     "b_part/02_y.ipynb", "tutorials/t.ipynb"]


def test_a_navigation_out_of_order_is_found():
    expected = ["index.html", "nbs/01_a.html", "nbs/02_b.html"]
    in_order = ["index.html", "nbs/01_a.html", "nbs/02_b.html", "ALGORITHMS.html"]
    assert site_check.order_problems(in_order, expected) == []
    assert "the lesson order" in site_check.order_problems(["index.html", "nbs/02_b.html", "nbs/01_a.html"],
                                                           expected)[0]
    assert "missing ['nbs/02_b.html']" in site_check.order_problems(["index.html", "nbs/01_a.html"], expected)[0]


def navigation(hooks) -> list:
    "The site's navigation as `on_config` sets it: [(section, [page uri, ...]), ...] (Home and Reference included)."
    config = hooks.on_config(SimpleNamespace(config_file_path=str(ROOT / "docs" / "mkdocs.yml"), nav=None))
    return [(name, [u for item in items for u in item.values()] if isinstance(items, list) else [items])
            for entry in config.nav for name, items in entry.items()]


def test_the_navigation_groups_the_lessons_by_part():
    "The lessons' sections are the parts, in the order of PARTS, then the tutorials; every lesson is in exactly one."
    hooks = site_check.site_hooks(ROOT)
    nav = navigation(hooks)
    sections = [name for name, _ in nav if name not in ("Home", "Reference")]
    assert sections == [name for _, name in hooks.PARTS] + ["Tutorials"], sections
    placed = [u for name, uris in nav if name not in ("Home", "Reference") for u in uris]
    assert placed == [p.relative_to(ROOT).as_posix() for p in lesson_order()]
    assert dict(nav)["1. GRPO's core"] == [f"nbs/{n}.ipynb" for n in ("01_grpo_step", "02_advantages", "03_loss",
                                                                     "04_logprobs")]


def test_a_lesson_s_part_comes_from_its_number():
    hooks = site_check.site_hooks(ROOT)
    assert [hooks.part_of(s) for s in ("01_grpo_step", "04_logprobs", "09_safety", "19_one_step", "20a_diversity",
                                       "50_reliability", "64_vllm", "index")] == [
        "1. GRPO's core", "1. GRPO's core", "2. The parts of a step", "2. The parts of a step", "3. The methods",
        "4. The trainer", "Appendix: speed and scale", "Lessons"]


@pytest.mark.browser
def test_a_clean_site_passes(tmp_path):
    r = site_sh(mini_repo(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "site_check: passed" in r.stdout and "search for 'advantages'" in r.stdout, r.stdout
    home = (tmp_path / "repo" / "_site" / "index.html").read_text()   # a file the site does not carry: on GitHub
    assert 'href="https://github.com/mmrgrpo/mmrgrpo/blob/main/configs/demo.yaml"' in home


@pytest.mark.browser
def test_a_broken_link_anchor_or_image_fails(tmp_path):
    repo = mini_repo(tmp_path)
    path = repo / "nbs" / "03_loss.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"].append(notebook("Next: [the missing lesson](18_missing.ipynb), [a heading](02_advantages.ipynb#nowhere)"
                                " and ![a figure](images/missing.png).")["cells"][0])
    write(path, nb)
    r = site_sh(repo)
    assert r.returncode == 1, r.stdout + r.stderr
    for problem in ["broken link nbs/18_missing.ipynb", "broken anchor nbs/02_advantages.html#nowhere",
                    "images/missing.png did not load", "FAILED, 3 problem(s)"]:
        assert problem in r.stdout, r.stdout


def github_anchor(heading: str) -> str:
    "The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_and_benchmark_pages_links_resolve_on_github():
    "Every relative link in README.md and the top-level pages names a file of the repository, and its anchor a heading."
    bad = []
    for page in sorted(ROOT.glob("*.md")):            # README.md, ALGORITHMS.md, BENCHMARKS*.md
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"): continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists(): bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in {github_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}:
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, bad


def test_github_anchors_are_computed_as_github_does():
    assert github_anchor("6. GPU check (`bench/gpu_check.sh`)") == "6-gpu-check-benchgpu_checksh"
    assert github_anchor("8. The issue's machine: a 2-core AMD EPYC") == "8-the-issues-machine-a-2-core-amd-epyc"
