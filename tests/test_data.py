"Tests for mmrgrpo.data: arithmetic tasks, per-step determinism, loading and validation, prompts."
import json, random, re
from pathlib import Path

import pytest

from mmrgrpo.data import (ArithmeticStream, DataError, EVAL_SEED, TRAIN_SEED, arithmetic_task, arithmetic_tasks,
                          holds_out_rows, load_tasks, split_held_out, task_source, tasks_for_step)
from mmrgrpo.prompts import DEFAULT_INSTRUCTION, check_prompt_lengths, default_shots, format_prompt


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_path)


# --- arithmetic

EXPR = re.compile(r"What is (.+)\?")

@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_arithmetic_answers_are_the_expressions_value(level):
    tasks = arithmetic_tasks(300, level, seed=11)
    for t in tasks:
        expr = EXPR.fullmatch(t["question"]).group(1)
        assert re.fullmatch(r"[\d +*-]+", expr), expr
        assert t["answer"] == str(eval(expr)), t
    assert len({t["question"] for t in tasks}) > 20              # not one task repeated


def test_arithmetic_levels_have_their_shape():
    operands = lambda t: [int(x) for x in re.findall(r"\d+", t["question"])]
    for t in arithmetic_tasks(200, 1):
        assert " + " in t["question"] and all(1 <= x <= 9 for x in operands(t))
    for t in arithmetic_tasks(200, 2):
        assert " + " in t["question"] and all(10 <= x <= 99 for x in operands(t))
    lv3 = arithmetic_tasks(200, 3)
    assert all(10 <= x <= 99 for t in lv3 for x in operands(t))
    assert any(" - " in t["question"] for t in lv3) and any(" + " in t["question"] for t in lv3)
    assert any(int(t["answer"]) < 0 for t in lv3)
    lv4 = arithmetic_tasks(200, 4)
    assert all(t["question"].count("*") == 1 and len(operands(t)) == 3 for t in lv4)
    assert any(" - " in t["question"] for t in lv4) and any(" + " in t["question"] for t in lv4)
    assert arithmetic_task(random.Random(0), 4)["question"] == arithmetic_tasks(1, 4, seed=0)[0]["question"]


def test_arithmetic_is_seeded():
    assert arithmetic_tasks(20, 3, seed=5) == arithmetic_tasks(20, 3, seed=5)
    assert arithmetic_tasks(20, 3, seed=5) != arithmetic_tasks(20, 3, seed=6)
    with pytest.raises(ValueError, match="use one of 1, 2, 3, 4"): arithmetic_tasks(1, 0)
    with pytest.raises(ValueError, match="use one of 1, 2, 3, 4"): ArithmeticStream(7)


def test_load_arithmetic_uses_disjoint_seeds():
    assert TRAIN_SEED != EVAL_SEED
    assert load_tasks("arithmetic:2", limit=8) == arithmetic_tasks(8, 2, seed=TRAIN_SEED)
    assert load_tasks("arithmetic:2", "test", limit=8) == arithmetic_tasks(8, 2, seed=EVAL_SEED)
    assert load_tasks("arithmetic:2", "test", limit=8) != load_tasks("arithmetic:2", limit=8)
    with pytest.raises(DataError, match="pass limit="): load_tasks("arithmetic:1")
    with pytest.raises(DataError, match="level 1, 2, 3 or 4"): load_tasks("arithmetic:x", limit=2)


# --- tasks_for_step

def test_tasks_for_step_stream_is_a_function_of_seed_and_step():
    s = ArithmeticStream(3)
    uninterrupted = [tasks_for_step(s, step, 6, seed=2) for step in range(10)]
    resumed = [tasks_for_step(ArithmeticStream(3), step, 6, seed=2) for step in range(4, 10)]
    assert resumed == uninterrupted[4:]
    assert tasks_for_step(s, 4, 6, seed=3) != uninterrupted[4]
    assert uninterrupted[4] != uninterrupted[5]
    assert tasks_for_step(ArithmeticStream(3, seed=1), 4, 6, seed=2) != uninterrupted[4]
    assert task_source("arithmetic:3", seed=1) == ArithmeticStream(3, 1)


def test_tasks_for_step_list_walks_seeded_epochs():
    records = [{"question": f"q{i}", "answer": str(i)} for i in range(7)]
    n, steps = 3, 7                                                # 21 items = exactly 3 epochs
    seq = [r["answer"] for s in range(steps) for r in tasks_for_step(records, s, n, seed=4)]
    epochs = [seq[i:i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == sorted(r["answer"] for r in records) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3                    # a new order each epoch
    assert [r["answer"] for r in tasks_for_step(records, 5, n, seed=4)] == seq[15:18]   # resume mid-run
    assert tasks_for_step(records, 0, n, seed=5) != tasks_for_step(records, 0, n, seed=4)
    out = tasks_for_step(records, 0, 2)
    out[0]["question"] = "changed"
    assert all(r["question"] != "changed" for r in records)        # copies
    with pytest.raises(DataError, match="empty"): tasks_for_step([], 0, 2)


# --- local copies (the excerpts in nbs/data; a full copy has the same layout)

def test_gsm8k_local(data_dir, monkeypatch):
    monkeypatch.delenv("MMRGRPO_DATA", raising=False)
    # source and licence
    assert all((data_dir / d / f).is_file() for d in ("gsm8k", "math500") for f in ("LICENSE", "NOTICE"))
    test = load_tasks("gsm8k", "test", data_dir=data_dir)
    assert len(test) == 50
    assert test[0]["answer"] == "18" and test[0]["question"].startswith("Janet’s ducks lay 16 eggs")
    assert test[0]["solution"].endswith("#### 18")
    train = load_tasks("gsm8k", data_dir=data_dir, limit=3)
    assert [t["answer"] for t in train] == ["72", "10", "5"]
    monkeypatch.setenv("MMRGRPO_DATA", str(data_dir))                # the environment variable works as well
    assert load_tasks("gsm8k", "test", limit=2) == test[:2]
    with pytest.raises(DataError, match="use 'train' or 'test'"): load_tasks("gsm8k", "validation", data_dir=data_dir)


def test_nothing_reads_outside_the_repository():
    """A fresh clone has no data folder beside it, and a fixed temporary path is shared by every user of a machine:
    nothing names either."""
    root = Path(__file__).resolve().parents[1]
    outside = re.compile(r"\.\./shared\b|[\"']/tmp/")
    found = [f"{f.relative_to(root)}: {m.group()}"
             for f in [*root.glob("nbs/*.ipynb"), *root.glob("mmrgrpo/*.py"), *root.glob("tests/*.py")]
             for m in outside.finditer(f.read_text())]
    assert found == []


def test_gsm8k_gold_strips_thousands_separators(data_dir):
    rows = [json.loads(l) for l in open(data_dir / "gsm8k" / "train.jsonl")]
    i = next(i for i, r in enumerate(rows) if "," in r["answer"].rsplit("####", 1)[1])
    got = load_tasks("gsm8k", data_dir=data_dir, limit=i + 1)[i]["answer"]
    assert got == rows[i]["answer"].rsplit("####", 1)[1].strip().replace(",", "") and "," not in got


def test_math500_local(data_dir):
    tasks = load_tasks("math500", "test", data_dir=data_dir)
    assert len(tasks) == 20
    assert tasks[0]["question"].startswith("Convert the point $(0,3)$ in rectangular coordinates")
    assert tasks[0]["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert tasks[1]["answer"] == "p - q" and tasks[0]["subject"] == "Precalculus"
    with pytest.raises(DataError, match="math500 has no 'train' split"): load_tasks("math500", data_dir=data_dir)


def test_hub_fallback_without_network(tmp_path, monkeypatch):
    import datasets
    monkeypatch.delenv("MMRGRPO_DATA", raising=False)
    calls = []
    def fake(name, config=None, split=None):
        calls.append((name, config, split))
        return [{"question": "How many?", "answer": "1,000 + 234 = 1,234\n#### 1,234"}]
    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert load_tasks("gsm8k", data_dir=tmp_path)[0]["answer"] == "1234"
    assert calls == [("openai/gsm8k", "main", "train")]
    assert load_tasks("someone/data:cfg", "test")[0]["question"] == "How many?"
    assert calls[-1] == ("someone/data", "cfg", "test")
    def offline(*a, **k): raise ConnectionError("no network")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"no local copy in .*gsm8k.*MMRGRPO_DATA"):
        load_tasks("gsm8k", data_dir=tmp_path)


# --- bad files

GOOD = b'{"question": "What is 1 + 1?", "answer": "2"}\n'

@pytest.mark.parametrize("name, data, message", [
    ("empty.jsonl", b"", "empty.jsonl: the file is empty"),
    ("blanklines.jsonl", b"\n  \n", "blanklines.jsonl: the file is empty"),
    ("json.jsonl", GOOD + b'{"question": "x", "answer": \n', "json.jsonl row 2: invalid JSON"),
    ("utf8.jsonl", GOOD * 2 + b'{"question": "caf\xe9?", "answer": "1"}\n', "utf8.jsonl row 3: invalid UTF-8"),
    ("field.jsonl", GOOD + b'{"q": "What is 2 + 2?", "answer": "4"}\n', "field.jsonl row 2: no field 'question'"),
    ("noanswer.jsonl", b'{"question": "What?"}\n', "noanswer.jsonl row 1: no field 'answer'"),
    ("blank.jsonl", GOOD + b'{"question": " ", "answer": "4"}\n', "blank.jsonl row 2: empty question"),
    ("gold.jsonl", GOOD * 3 + b'{"question": "Half?", "answer": "\\\\boxed{}"}\n',
     "gold.jsonl row 4: gold answer '\\\\boxed{}' cannot be parsed"),
    ("list.jsonl", GOOD + b'[1, 2]\n', "list.jsonl row 2: expected a JSON object"),
    ("empty.json", b"  ", "empty.json: the file is empty"),
    ("bad.json", b'[\n{"question": "a", "answer": "1"},\n{"question": }\n]', "bad.json line 3: invalid JSON"),
    ("utf8.json", b'[\n{"question": "caf\xe9", "answer": "1"}]', "utf8.json line 2: invalid UTF-8"),
    ("field.json", b'[{"question": "a", "answer": "1"}, {"answer": "2"}]', "field.json row 2: no field 'question'"),
])
def test_bad_rows_are_named(tmp_path, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError) as e: load_tasks(str(tmp_path / name))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gsm8k_without_hashes_is_named(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text('{"question": "a?", "answer": "#### 3"}\n'
                                                    '{"question": "b?", "answer": "3"}\n')
    with pytest.raises(DataError, match=r"train.jsonl row 2: the GSM8K answer has no '#### <number>' line"):
        load_tasks("gsm8k", data_dir=tmp_path)


def test_skip_bad_rows_counts(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(GOOD + b'{"question": "x", "answer": \n' + b'{"question": "caf\xe9", "answer": "1"}\n'
                  + b'{"q": "What is 2 + 2?", "answer": "4"}\n' + b'{"question": "", "answer": "4"}\n'
                  + b'{"question": "Half?", "answer": "\\\\boxed{}"}\n' + b"\n" + GOOD)
    records, skipped = load_tasks(str(p), skip_bad_rows=True, return_skipped=True)
    assert (len(records), skipped) == (2, 5)
    assert load_tasks(str(p), skip_bad_rows=True) == records
    with pytest.raises(DataError, match="row 2: invalid JSON"): load_tasks(str(p))
    (tmp_path / "allbad.jsonl").write_bytes(b'{"q": 1}\n{"q": 2}\n')
    with pytest.raises(DataError, match=r"no usable rows \(2 bad ones skipped\)"):
        load_tasks(str(tmp_path / "allbad.jsonl"), skip_bad_rows=True)


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows)); return str(path)


def test_gold_answers_are_strings_or_numbers(tmp_path):
    """JSON true, lists and dicts are not answers (str(True) would parse as the product of four symbols and score
    completions)."""
    p = jsonl(tmp_path / "t.jsonl", [{"question": "a?", "answer": 6}, {"question": "b?", "answer": 0.5},
                                     {"question": "c?", "answer": True}, {"question": "d?", "answer": [1, 2]},
                                     {"question": "e?", "answer": {"x": 1}}])
    with pytest.raises(DataError,
                       match=r"t.jsonl row 3: gold answer True is a bool, not a string or a number; fix the row"):
        load_tasks(p)
    records, skipped = load_tasks(p, skip_bad_rows=True, return_skipped=True)
    assert [r["answer"] for r in records] == ["6", "0.5"] and skipped == 3
    (tmp_path / "inf.jsonl").write_text('{"question": "a?", "answer": 1e400}\n')                  # JSON reads it as inf
    with pytest.raises(DataError, match=r"inf.jsonl row 1: gold answer inf is not a finite number"):
        load_tasks(str(tmp_path / "inf.jsonl"))
    # Python will not read an integer of more than 4300 digits: a row error, not a crash
    for ext in ("jsonl", "json"):
        (tmp_path / f"long.{ext}").write_text('[{"question": "b?", "answer": ' + "7" * 5000 + "}]")
        with pytest.raises(DataError, match=r"long.json.*invalid JSON \(Exceeds the limit \(4300 digits\)"):
            load_tasks(str(tmp_path / f"long.{ext}"))


def test_slow_and_huge_gold_answers_are_cut_off(tmp_path):
    "A gold answer is parsed in a verifier process under the time limit, and the error quotes only its start."
    huge, nested = "1" * 10**7, "{" * 5000 + "1" + "}" * 5000
    p = jsonl(tmp_path / "t.jsonl", [{"question": "a?", "answer": "7"}, {"question": "b?", "answer": huge},
                                     {"question": "c?", "answer": nested}])
    with pytest.raises(DataError) as e: load_tasks(p, gold_timeout=0.5)
    msg = str(e.value)
    assert "t.jsonl row 2: gold answer '1111" in msg and "took more than 0.5 s to parse" in msg, msg[:300]
    assert len(msg) < 300 and "\n" not in msg
    records, skipped = load_tasks(p, gold_timeout=0.5, skip_bad_rows=True, return_skipped=True)
    assert (records, skipped) == ([{"question": "a?", "answer": "7"}], 2)


def test_other_formats_and_fields(tmp_path):
    import pyarrow as pa, pyarrow.parquet as pq
    rows = [{"problem": "What is 3 + 3?", "sol": 6, "id": 1}, {"problem": "Half of 1?", "sol": "\\frac{1}{2}", "id": 2}]
    want = [{"question": "What is 3 + 3?", "answer": "6", "id": 1},
            {"question": "Half of 1?", "answer": "\\frac{1}{2}", "id": 2}]
    (tmp_path / "t.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("\n".join(map(json.dumps, rows)))          # JSON Lines named .json
    pq.write_table(pa.Table.from_pylist([{**r, "sol": str(r["sol"])} for r in rows]), tmp_path / "t.parquet")
    for f in ("t.json", "lines.json", "t.parquet"):
        assert load_tasks(str(tmp_path / f), question_field="problem", answer_field="sol") == want, f
    assert load_tasks(str(tmp_path / "t.json"), question_field="problem", answer_field="sol", limit=1) == want[:1]
    (tmp_path / "arithmetic_mine.jsonl").write_bytes(GOOD)                          # a file, not the built-in tasks
    assert load_tasks(str(tmp_path / "arithmetic_mine.jsonl")) == [json.loads(GOOD)]
    with pytest.raises(DataError, match="no such file"): load_tasks(str(tmp_path / "missing.jsonl"))
    (tmp_path / "t.csv").write_text("question,answer\n")
    with pytest.raises(DataError, match="unknown file type '.csv'"): load_tasks(str(tmp_path / "t.csv"))


# --- held-out rows of a file

def test_split_held_out_has_no_overlap():
    records = [{"question": f"q{i % 9}", "answer": str(i)} for i in range(12)]      # q0, q1, q2 appear twice
    train, held = split_held_out(records, 3, "t.jsonl")
    questions = lambda rs: [r["question"] for r in rs]
    assert len(held) == len(set(questions(held))) == 3 and not set(questions(train)) & set(questions(held))
    assert set(questions(train)) | set(questions(held)) == set(questions(records))
    assert train == [r for r in records if r["question"] not in questions(held)]       # the file's order
    assert questions(held) == sorted(questions(held), key=questions(records).index)
    assert split_held_out(records, 3, "t.jsonl") == (train, held)                       # a fixed seed, not the run's
    assert len(split_held_out(records, 100)[1]) == 4                                    # at most half of 9 questions
    with pytest.raises(DataError,
                       match=r"one.jsonl: cannot hold 5 of its 1 distinct question\(s\) out .* set eval_task"):
        split_held_out(records[:1], 5, "one.jsonl")


def test_only_files_hold_rows_out(tmp_path):
    p = jsonl(tmp_path / "t.jsonl", [{"question": "a?", "answer": "1"}])
    assert holds_out_rows(p) and holds_out_rows(str(tmp_path / "missing.parquet"))
    assert not holds_out_rows(p, eval_task="other.jsonl")
    assert not any(holds_out_rows(t) for t in ("gsm8k", "math500", "arithmetic:2", "someone/data", "someone/data:cfg"))


def test_training_on_a_file_evaluates_on_rows_it_never_trains_on(tmp_path, monkeypatch):
    "A file has no test split: the trainer holds rows of it out instead of evaluating on its training rows."
    import mmrgrpo.trainer as T
    from mmrgrpo.config import load_config
    p = jsonl(tmp_path / "tasks.jsonl", [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)])
    seen = {}
    class Stop(Exception): pass
    def fit_prompts(tokenizer, c, tasks, task, split="train"):          # the trainer's tasks, just after loading
        seen[split] = [t["question"] for t in tasks]
        if split == "test": raise Stop
        return tasks, 0
    monkeypatch.setattr(T, "fit_prompts", fit_prompts)
    c = load_config(model="tiny-random", task=p, eval_size=5, output_dir=str(tmp_path / "run"))
    import torch
    # stops before any use
    with pytest.raises(Stop): T.train(c, model=torch.nn.Linear(1, 1), tokenizer=None, progress=False)
    assert len(seen["test"]) == 5 and len(seen["train"]) == 15 and not set(seen["train"]) & set(seen["test"])


# --- prompts

def test_format_prompt(tok):
    q = "What is 4 + 5?"
    zero = format_prompt(tok, q)
    one = format_prompt(tok, q, shots=default_shots("arithmetic:1"))
    assert zero.startswith("<|im_start|>system\n") and zero.endswith("<|im_start|>assistant\n")
    assert one.endswith(f"<|im_start|>user\n{q}\n{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    assert one.index("What is 2 + 3?") < one.index("\\boxed{5}") < one.index(q)
    assert "\\boxed{}" in DEFAULT_INSTRUCTION
    n = lambda p: len(tok(p, add_special_tokens=False).input_ids)
    assert n(zero) < n(one) < n(format_prompt(tok, q, shots=default_shots("arithmetic:1", 2)))
    custom = format_prompt(tok, q, system_prompt="Be brief.", instruction="")
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>") and DEFAULT_INSTRUCTION not in custom
    assert "How many muffins" in format_prompt(tok, q, shots=default_shots("gsm8k"))
    assert default_shots("math500", 0) == []
    with pytest.raises(ValueError, match="use 0 to 2"): default_shots("gsm8k", 5)


def test_check_prompt_lengths(tok):
    prompts = [format_prompt(tok, q, shots=default_shots("arithmetic"))
               for q in ["What is 1 + 1?", "x " * 300, "What is 2 + 2?", "y " * 400]]
    lengths = [len(tok(p, add_special_tokens=False).input_ids) for p in prompts]
    assert check_prompt_lengths(tok, prompts, max(lengths)) == [0, 1, 2, 3]
    limit = max(lengths[0], lengths[2])
    with pytest.raises(DataError, match=rf"my.jsonl row 2: the prompt has {lengths[1]} tokens, "
                                        rf"more than max_prompt_length={limit}"):
        check_prompt_lengths(tok, prompts, limit, source="my.jsonl")
    assert check_prompt_lengths(tok, prompts, limit, skip_bad_rows=True) == [0, 2]


def test_slips_in_task_data_dir_and_embedder_name_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"task 'arithmatic:1': did you mean 'arithmetic:1'\?"):
        load_tasks("arithmatic:1", limit=2)
    with pytest.raises(DataError, match=r"data_dir='.*none': no such folder"):
        load_tasks("gsm8k", data_dir=tmp_path / "none")
    with pytest.raises(DataError, match=r"is a folder: name a \.jsonl, \.json, \.parquet file in it"):
        load_tasks(str(tmp_path))
    from mmrgrpo.mmr import load_embedder
    with pytest.raises(FileNotFoundError, match=r"embedding_model='\./nodir': no such folder"): load_embedder("./nodir")
