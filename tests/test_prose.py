"""Numbers in a lesson's prose are the numbers its outputs show.

A markdown cell right after an executed code cell with text outputs talks about those outputs (or introduces the code
cell right below it). Every decimal number it writes (one with a decimal point: 24.4, -0.58, 0.61x, 3.4e38) must be a
number those cells print, as printed or rounded to the digits the prose gives; a signed number must have its sign. A
re-run that changes an output, or prose edited without one, then fails here until the two agree again.

Numbers that are no output (a setting the prose names, a measurement quoted from a benchmark's results file) are listed
below, per notebook, each with its reason; an entry that no longer matches anything is an error too, so the lists stay
small."""
import copy, json, re
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
NOTEBOOKS = sorted(NBS.glob("*.ipynb")) + sorted((NBS / "tutorials").glob("*.ipynb"))


def lesson(path: Path) -> str:
    "A notebook's name without its place in the reading order (21_pruning: pruning), which renumbering keeps."
    return re.sub(r"^\d+[a-z]?_", "", path.stem)


LESSONS = {lesson(p): p for p in NOTEBOOKS}

# Numbers in prose that are no output: lesson -> {the number as written: why}
NOT_OUTPUTS = {
    "one_step": {"0.2": "the clip range in the loss's formula (1 - 0.2, 1 + 0.2): a setting"},
    "config_reference": {"8.0": "the compute capability from which GPUs run bfloat16: a hardware threshold",
                         "0.2": "top_entropy_quantile: 0.2 and keep_ratio: 0.2, settings the prose spells out"},
    "config": {"1.16": "the version of TRL whose defaults the prose compares with ours: a version number"},
}
# Markdown cells that quote a measurement made elsewhere, which they name (a bench/ results file or BENCHMARKS*.md):
# (lesson, cell id) -> why
ELSEWHERE = {
    ("sampler_copy", "efe362ee"): "the generation benchmark at c1d5ab7 (generation.json as of 2996c64)",
    ("kvcache", "6273341e"): "the room's effect on decoding, from bench/results/generation_kvcache_room*.json",
    ("fused_decode", "66b4fc94"): "one decode step, from bench/results/decode_step.json",
    ("matmul_attention", "2caa600f"): "the update with and without it, from BENCHMARKS_HISTORY.md section 8",
    ("bf16_update", "3ded8f59"): "the input casts' cost, from compute_efficiency_amd_input_casts.json",
    ("bf16_update", "ad6606a5"): "the three arms' update times, from bench/results/compute_efficiency_amd.json",
    ("bf16_update", "65eb98cb"): "the micro-batch table, from bench/results/overheads.json and overheads_auto.json",
    ("sampling", "af961d5c"): "the evaluation prefill's memory, from BENCHMARKS_HISTORY.md section 7",
    ("sampling", "5b1f0c2e"): "the decode loops' times, from bench/results/generation.json (BENCHMARKS_HISTORY.md 0)",
    ("step", "c9804b2b"): "micro-batch sizes' time, from bench/overheads.py as BENCHMARKS_HISTORY.md reports it",
}
# Markdown cells that also quote the outputs of a cell further away: (lesson, markdown cell id) -> code cell ids
QUOTES = {
    ("mmr", "eae3c66d"): ("e5d6df75",),      # the cost summary quotes the embedding time measured above
}
# Lessons with mismatches left to fix: lesson -> what to fix (cell index, number in prose, what the outputs say)
KNOWN_MISMATCHES = {}

# a token of prose that is a decimal number: a sign, the number, a range's second number, a unit, a sentence's full stop
PROSE_NUMBER = re.compile(r"^(?P<sign>[-+−]?)(?P<num>\d+\.\d+(?:[eE][-+]?\d+)?)"
                          r"(?:[-–](?P<num2>\d+\.\d+(?:[eE][-+]?\d+)?))?[A-Za-zµ%]*\.?$")
SEPARATORS = re.compile(r"[\s,;:()\[\]{}`'\"*|=<>~≈/]+")
# any number an output prints; a minus sign counts when it does not join two words (a-1)
OUTPUT_NUMBER = re.compile(r"(?<![\w.])(?P<sign>[-−]?)(?<![\w.][-−])(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def output_text(cell: dict) -> str:
    "The text a code cell's saved outputs show: streams, text results (not a figure's repr), errors."
    parts = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream": parts.append("".join(o["text"]))
        elif o["output_type"] == "error": parts.append(f"{o['ename']}: {o['evalue']}")
        elif not any(k.startswith("image/") for k in o.get("data", {})):
            parts.append("".join(o.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def output_numbers(text: str) -> list:
    "(value, decimals) of every number in `text`; decimals None for a whole number, which rounds nothing."
    out = []
    for m in OUTPUT_NUMBER.finditer(text):
        num = m.group("num")
        whole = not any(ch in num for ch in ".eE")
        out.append((float(num) * (-1 if m.group("sign") else 1), None if whole else _decimals(num)))
    return out


def _decimals(num: str) -> int:
    "Digits after the point, as a power of ten of the last digit's place (3.4e38: -37)."
    mantissa, _, exp = num.lower().partition("e")
    return len(mantissa.partition(".")[2]) - int(exp or 0)


def prose_text(source: str) -> str:
    "A markdown cell's prose without code blocks, link targets, URLs and HTML tags."
    source = re.sub(r"```.*?```", " ", source, flags=re.S)
    source = "\n".join(l for l in source.split("\n") if not l.startswith("    "))
    source = re.sub(r"\]\([^)]*\)", "] ", source)
    source = re.sub(r"https?://\S+|<[^>]+>", " ", source)
    return source


def prose_numbers(source: str) -> list:
    "(as written, sign, value, decimals) of each decimal number in a markdown cell's prose."
    out, tokens = [], SEPARATORS.split(prose_text(source))
    for before, token in zip([""] + tokens, tokens):
        m = PROSE_NUMBER.match(token)
        if not m or before.lower() == "arxiv": continue
        for num in filter(None, (m.group("num"), m.group("num2"))):
            sign = m.group("sign") if num == m.group("num") else ""
            out.append((sign + num, sign, float(num), _decimals(num)))
    return out


def shown(sign: str, value: float, decimals: int, printed: list) -> bool:
    "Whether a number written with `decimals` digits (and `sign`) is one of `printed`, as printed or rounded."
    for y, d in printed:
        if sign in "-−" and sign and y >= 0: continue
        if sign == "+" and y < 0: continue
        tolerance = 1e-9 * max(1.0, value) if d is None else 0.5 * 10.0 ** -min(decimals, d) * (1 + 1e-9)
        if abs(abs(y) - value) <= tolerance: return True
    return False


def mismatches(nb: dict, name: str, allowed: dict = None, elsewhere: dict = None, quotes: dict = None) -> list:
    "(cell index, number in prose, what the outputs say) for each decimal in prose that the outputs it describes lack."
    allowed = NOT_OUTPUTS.get(name, {}) if allowed is None else allowed
    elsewhere = ELSEWHERE if elsewhere is None else elsewhere
    quotes = QUOTES if quotes is None else quotes
    cells, bad = nb["cells"], []
    by_id = {c.get("id"): c for c in cells}
    for i, cell in enumerate(cells):
        prev = cells[i - 1] if i else None
        if cell["cell_type"] != "markdown" or not prev or prev["cell_type"] != "code": continue
        if not output_text(prev).strip() or (name, cell.get("id")) in elsewhere: continue
        sources = [prev] + ([cells[i + 1]] if i + 1 < len(cells) and cells[i + 1]["cell_type"] == "code" else [])
        sources += [by_id[q] for q in quotes.get((name, cell.get("id")), ())]
        text = "\n".join(output_text(c) for c in sources)
        printed = output_numbers(text)
        for written, sign, value, decimals in prose_numbers("".join(cell["source"])):
            if written.lstrip("+-−") in allowed or shown(sign, value, decimals, printed): continue
            bad.append((i, written, " | ".join(l.strip() for l in text.strip().split("\n"))[:300]))
    return bad


def load(path: Path) -> dict: return json.loads(path.read_text())


def test_a_planted_mismatch_is_caught():
    "The checker finds a number the outputs do not show, a wrong sign, a wrong rounding; it passes what they show."
    def nb(prose, outputs="batch: 24.445 ms\nadvantages [1.154, -0.577, -0.577]\n", after=None):
        cells = [{"cell_type": "code", "id": "c0", "source": [], "outputs": [
                     {"output_type": "stream", "name": "stdout", "text": [outputs]}]},
                 {"cell_type": "markdown", "id": "m1", "source": [prose]}]
        if after is not None:
            cells.append({"cell_type": "code", "id": "c2", "source": [],
                          "outputs": [{"output_type": "stream", "name": "stdout", "text": [after]}]})
        return {"cells": cells}
    def check(notebook, allowed={}, elsewhere={}, quotes={}):
        return mismatches(notebook, "x", allowed, elsewhere, quotes)
    assert check(nb("24.4 ms for the batch, advantages `[+1.15, -0.58, -0.58]`, |A| = 0.577")) == []
    assert check(nb("24.445 ms, and 24 ms in whole numbers (not checked)")) == []
    assert [b[1] for b in check(nb("25.4 ms for the batch"))] == ["25.4"]
    assert [b[1] for b in check(nb("24.5 ms, rounded the wrong way"))] == ["24.5"]
    assert [b[1] for b in check(nb("the advantages become [+0.58, -1.15]"))] == ["+0.58", "-1.15"]
    assert [b[1] for b in check(nb("between 1.154-1.16 s"))] == ["1.16"]          # both ends of a range
    assert check(nb("25.4 ms", after="the next cell: 25.4 ms\n")) == []            # prose introducing the cell below
    assert check(nb("a setting 0.7 and 25.4 ms"), allowed={"0.7": "", "25.4": ""}) == []
    assert check(nb("25.4 ms"), elsewhere={("x", "m1"): ""}) == []
    assert check(nb("Qwen2.5-0.5B, version 2.9.1, arXiv 2601.09085, [a link](x/1.5.md)")) == []   # no quantities
    # prose after prose, or after a cell that printed nothing, describes no output here
    two_prose = [{"cell_type": "markdown", "source": ["a"]}, {"cell_type": "markdown", "source": ["25.4"]}]
    assert check({"cells": two_prose}) == []
    assert check(nb("25.4 ms", outputs="")) == []
    # a real lesson: the cost prose of 20_mmr, its number changed
    real = load(LESSONS["mmr"])
    assert mismatches(real, "mmr") == []
    cell = next(c for c in real["cells"] if c.get("id") == "eae3c66d")
    written = prose_numbers("".join(cell["source"]))[0][0]
    planted = copy.deepcopy(real)
    target = next(c for c in planted["cells"] if c.get("id") == "eae3c66d")
    target["source"] = ["".join(target["source"]).replace(written, "99.9", 1)]
    assert [b[1] for b in mismatches(planted, "mmr")] == ["99.9"]


def _param(path: Path):
    known = KNOWN_MISMATCHES.get(lesson(path))
    marks = [pytest.mark.xfail(strict=True, reason=f"prose to fix: {known}")] if known else []
    return pytest.param(path, id=path.name, marks=marks)


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_numbers_in_prose_are_in_the_outputs_they_describe(path):
    bad = mismatches(load(path), lesson(path))
    assert not bad, "\n".join(f"{path.name} cell {i}: {n!r} is in the prose, the outputs say: {o}" for i, n, o in bad)


def test_the_exceptions_are_needed_and_name_their_source():
    "Every allowed number is one the check would otherwise reject; every cell quoting elsewhere names where."
    assert len(LESSONS) == len(NOTEBOOKS), "two notebooks differ only in their number"
    for name, numbers in NOT_OUTPUTS.items():
        flagged = {n.lstrip("+-−") for _, n, _ in mismatches(load(LESSONS[name]), name, allowed={})}
        assert set(numbers) <= flagged, f"{name}: {sorted(set(numbers) - flagged)} need no exception now"
    for (name, cid), why in ELSEWHERE.items():
        cells = load(LESSONS[name])["cells"]
        index = next(i for i, c in enumerate(cells) if c.get("id") == cid)
        source = "".join(cells[index]["source"])
        assert "bench/" in source or "BENCHMARKS" in source, f"{name} {cid} does not name its measurement"
        others = {k: v for k, v in ELSEWHERE.items() if k != (name, cid)}
        flagged = {i for i, _, _ in mismatches(load(LESSONS[name]), name, elsewhere=others)}
        assert index in flagged, f"{name} {cid} ({why}) needs no exception now"
    for (name, cid), code_ids in QUOTES.items():
        ids = {c.get("id") for c in load(LESSONS[name])["cells"]}
        assert {cid, *code_ids} <= ids, f"{name}: cells {sorted({cid, *code_ids} - ids)} are gone"


def printable_hardware() -> set:
    "Every CPU description the code can print: `native_cpu_support()` for each (amx, avx512_bf16) answer, and AVX2's."
    from unittest import mock
    from mmrgrpo import models
    names = {models.AVX2_CPU.name}
    for amx in (False, True):
        for bf16 in (False, True):
            says = {"cpu._is_amx_tile_supported": amx, "cpu._is_avx512_bf16_supported": bf16}
            with mock.patch.object(models, "_torch_says", lambda q: says.get(q, False)):
                names.add(models.native_cpu_support().name)
    return names


DTYPE = r"(?:off|float32|float16|bfloat16|float64)"
GPU = r"CUDA compute capability \d+\.\d+"


def precision_problems(text: str, hardware: set) -> list:
    "Each `precision: weights ...` line of `text` that names dtypes or hardware the code cannot print."
    lines = re.findall(r"^precision: weights .*$", text, re.M)
    where = "|".join(map(re.escape, hardware))
    ok = re.compile(rf"^precision: weights {DTYPE}, autocast {DTYPE} \((?:{where}|{GPU})\)")
    return [l for l in lines if not ok.match(l)]


def test_a_stale_precision_line_is_caught():
    hardware = printable_hardware()
    assert "CPU with avx512_bf16" in hardware and len(hardware) >= 4, hardware
    good = "precision: weights float32, autocast bfloat16 (CPU with avx512_bf16); base 4-bit; sampling from the policy"
    gpu = "precision: weights bfloat16, autocast off (CUDA compute capability 8.0)"
    stale = "precision: weights float32, autocast bfloat16 (CPU with amx_bf16, avx512_bf16)"
    assert precision_problems("\n".join([good, gpu, stale, "other line"]), hardware) == [stale]
    assert precision_problems("precision: weights fp32, autocast bf16 (CPU with avx512_bf16)", hardware) != []


# Notebooks whose stored precision lines the code can no longer print: name -> where, and who fixes it
KNOWN_PRECISION = {}    # notebook -> why a stored precision line is stale (strict xfail); empty: none is


def _precision_param(path: Path):
    known = KNOWN_PRECISION.get(path.stem)
    marks = [pytest.mark.xfail(strict=True, reason=f"stale precision line: {known}")] if known else []
    return pytest.param(path, id=path.name, marks=marks)


@pytest.mark.parametrize("path", [_precision_param(p) for p in NOTEBOOKS])
def test_stored_precision_lines_are_ones_the_code_prints(path):
    text = "\n".join(output_text(c) for c in load(path)["cells"] if c["cell_type"] == "code")
    assert precision_problems(text, printable_hardware()) == []


def broken_source_links(nb: dict) -> list:
    "Ids of code cells whose stored outputs (any format) hold a show_doc source link with no line (`#LNone`)."
    def texts(o): return [o.get("text", "")] + list(o.get("data", {}).values())
    flat = lambda t: "".join(t) if isinstance(t, list) else str(t)
    return [c.get("id") for c in nb["cells"] if c["cell_type"] == "code"
            and any("#LNone" in flat(t) for o in c.get("outputs", []) for t in texts(o))]


def test_a_source_link_with_no_line_is_caught():
    link = "[source](https://github.com/mmrgrpo/mmrgrpo/blob/main/mmrgrpo/safety.py#LNone)"
    cell = lambda i, md: {"cell_type": "code", "id": i, "outputs": [{"output_type": "execute_result",
                                                                     "data": {"text/markdown": md}}]}
    cells = [cell("a", [link]), cell("b", "no link"), cell("c", link[:-5] + "L12)")]
    assert broken_source_links({"cells": cells}) == ["a"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_stored_show_doc_link_lacks_its_line(path):
    "nbdev 3.3.26 links `#LNone` where it looks a line up by the full name: there, show_doc with MarkdownRenderer."
    assert broken_source_links(load(path)) == [], f"{path.name}: show_doc(f, renderer=MarkdownRenderer) in these cells"
