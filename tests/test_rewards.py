"""Tests for mmrgrpo.rewards and mmrgrpo.verifier_pool: the verifier's time limit, hostile completions, and
reward-function checking.

The `_score_fn` hooks below are imported by name inside the verifier processes, so this module keeps its top-level
imports light (torch is imported inside the tests that need it)."""
import functools, math, os, signal, subprocess, sys, threading, time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import mmrgrpo.rewards as V
from mmrgrpo.rewards import (RewardFunctionError, compute_rewards, extract_boxed, format_reward, parse_gold,
                             reward_counters, reward_name)
from mmrgrpo.rewards import (accuracy_reward, check_golds, cosine_reward, get_reward_funcs, shutdown_verifier,
                             verify_batch)

ROOT = Path(__file__).resolve().parents[1]
TOWER = "\\boxed{9^{9^{9^{9}}}}"                     # SymPy sets out to compute 9^(9^387420489): never finishes
# math-verify's parser does not come back from this either
NESTED = "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"


# Hooks that replace the scorer inside the workers (they must be importable there, hence module level).
def _sleepy(gold, completion): time.sleep(60); return 1.0
def _raises(gold, completion): raise RuntimeError("scorer bug")
def _crashes(gold, completion): os._exit(3)
def _echo(gold, completion): return float(gold == completion)


def _delta(before: dict) -> dict:
    after = reward_counters()
    return {k: after[k] - before[k] for k in after}


def _worker_pids() -> list[int]:
    return [w.proc.pid for w in V._POOL.workers]


def _alive(pid: int) -> bool:
    "True while `pid` runs (a zombie nobody reaped yet counts as gone)."
    try: state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError): return False
    return state not in ("Z", "X")


def _gone_within(pids, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids): return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------- gold answers and boxes

@pytest.mark.parametrize("gold,value", [("42", 42), ("-3", -3), ("1,234", 1234), ("-1,000,000", -1000000), (" 7 ", 7),
                                        (7, 7)])
def test_parse_gold_numbers(gold, value):
    assert parse_gold(gold)[0] == value


@pytest.mark.parametrize("gold", [True, False, None, [1, 2], {"a": 1}, float("nan"), float("inf")])
def test_parse_gold_accepts_only_strings_and_numbers(gold):
    """str(True) parses as the product E*r*t*u of four symbols; a list or dict as a set or worse. None of them is an
    answer."""
    with pytest.raises(ValueError, match=r"is a \w+, not a string or a number|is not a finite number"): parse_gold(gold)


def test_a_gold_answer_that_is_no_answer_scores_nothing():
    before = reward_counters()
    assert accuracy_reward(["q"] * 2, ["\\boxed{True}", "\\boxed{1}"], answer=[True, 1]) == [0.0, 1.0]
    assert _delta(before) == {"timeouts": 0, "errors": 1}


def test_check_golds_bounds_time_and_messages():
    """Gold answers are parsed in the verifier processes, under a time limit; what comes back is a short reason per
    answer."""
    nested, huge = "{" * 5000 + "1" + "}" * 5000, "1" * 10**7       # minutes of parsing each, in the main process
    before = reward_counters()
    why = check_golds(["18", 0.5, True, [1], "\\boxed{}", nested, huge], timeout=0.5)
    assert why[:5] == [None, None, "is a bool, not a string or a number", "is a list, not a string or a number",
                       "cannot be parsed"]
    assert all(w.startswith("took more than 0.5 s to parse") for w in why[5:]), why[5:]
    assert _delta(before) == {"timeouts": 0, "errors": 0}              # data checks are not reward metrics
    assert check_golds([]) == [] and verify_batch(["5"], ["\\boxed{5}"]) == [1.0]
    with pytest.raises(ValueError, match="positive number of seconds"): check_golds(["1"], timeout=0)


def test_parse_gold_messages_are_short():
    with pytest.raises(ValueError) as e: parse_gold(["x" * 10**6])
    assert len(str(e.value)) < 200


def test_parse_gold_latex_and_boxed_agree():
    half = parse_gold("0.5")[0]
    assert parse_gold("\\frac{1}{2}")[0] == half
    assert parse_gold("\\boxed{\\frac{1}{2}}")[0] == half
    assert parse_gold("$\\frac{1}{2}$")[0] == half


@pytest.mark.parametrize("gold", ["", "   ", "\\boxed{}"])
def test_parse_gold_rejects_empty(gold):
    with pytest.raises(ValueError) as e: parse_gold(gold)
    assert str(e.value) == f"unparseable gold answer {gold!r}"


def test_extract_boxed_cases():
    assert extract_boxed("x = \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert extract_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_boxed("\\boxed{1} and \\boxed{2") == "1"
    assert extract_boxed("nothing") is None
    assert extract_boxed("") is None


@pytest.mark.parametrize("text", [NESTED, "\\boxed{" * 10_000, "{" * 10_000 + "\\boxed{5", "}" * 10_000,
                                  "\\boxed{" + "{}" * 50_000 + "}"])
def test_extract_boxed_linear_on_hostile_input(text):
    start = time.perf_counter()
    out = extract_boxed(text)
    assert time.perf_counter() - start < 0.5
    assert out is None or isinstance(out, str)


# ---------------------------------------------------------------- verification under a time limit

def test_verify_batch_scores_in_order():
    golds = ["18", "18", "\\frac{1}{2}", "1,234", "18"]
    completions = ["so \\boxed{18}.", "\\boxed{26}", "\\boxed{0.5}", "\\boxed{1234}", "She makes 18 dollars a day."]
    assert verify_batch(golds, completions) == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_verify_batch_is_fast_once_warm():
    verify_batch(["1"], ["\\boxed{1}"])
    start = time.perf_counter()
    assert verify_batch(["2"] * 4, ["\\boxed{2}", "\\boxed{3}", "2", ""]) == [1.0, 0.0, 1.0, 0.0]
    assert time.perf_counter() - start < 1.0


def test_verify_batch_argument_checks():
    with pytest.raises(ValueError, match="one gold answer per completion"): verify_batch(["1"], ["1", "2"])
    with pytest.raises(ValueError, match="positive number of seconds"): verify_batch(["1"], ["1"], timeout=0)
    assert verify_batch([], []) == []


HOSTILE = {
    "empty": "",
    "whitespace": " \n\t ",
    "unterminated": "Let me think step by step. " * 2000 + "so the answer is \\boxed{1",
    "nested braces": NESTED,
    "open boxes": "\\boxed{" * 10_000,
    "power tower": TOWER,
    "huge number": "\\boxed{1" + "0" * 5000 + "}",
    "huge number, unboxed": "1" + "0" * 5000,
    "unicode": "答案是 ∞ ℵ₀ 🙂 \u202e \\boxed{ℵ₀ · ∑}",
    "lone surrogate": "\ud800 \\boxed{\udfff}",
    "control characters": "\x00\x1b[31m \\boxed{\x00}",
}


def test_hostile_completions_score_zero_within_the_limit():
    timeout, names = 1.0, list(HOSTILE)
    golds, completions = ["42"] * (len(names) + 1), [HOSTILE[n] for n in names] + ["\\boxed{42}"]
    before, start = reward_counters(), time.perf_counter()
    scores = verify_batch(golds, completions, timeout=timeout)
    elapsed = time.perf_counter() - start
    assert dict(zip(names + ["control"], scores)) == {**{n: 0.0 for n in names}, "control": 1.0}
    assert _delta(before)["timeouts"] >= 2                   # at least the power tower and the nested braces
    assert elapsed < len(completions) * timeout + 15, f"{elapsed:.1f} s"


def test_real_slow_input_is_cut_off_and_counted():
    before, start = reward_counters(), time.perf_counter()
    assert verify_batch(["42", "42"], [TOWER, "\\boxed{42}"], timeout=1.0) == [0.0, 1.0]
    assert _delta(before) == {"timeouts": 1, "errors": 0}
    assert time.perf_counter() - start < 10
    assert verify_batch(["5"], ["\\boxed{5}"]) == [1.0]      # the replacement worker scores normally


def test_slow_scorer_is_killed_and_replaced():
    verify_batch(["1"], ["1"])
    pids = _worker_pids()
    n, timeout = 4, 0.5
    before, start = reward_counters(), time.perf_counter()
    assert verify_batch(["1"] * n, ["1"] * n, timeout=timeout, _score_fn=_sleepy) == [0.0] * n
    elapsed = time.perf_counter() - start
    assert _delta(before) == {"timeouts": n, "errors": 0}
    assert elapsed < n * timeout + 15, f"{elapsed:.1f} s: the parent waited on stuck workers"
    assert _gone_within(pids, 5), "timed-out workers must be killed"
    assert verify_batch(["1", "1"], ["1", "2"], timeout=5, _score_fn=_echo) == [1.0, 0.0]


def test_scorer_errors_and_crashes_count_as_errors():
    before = reward_counters()
    assert verify_batch(["1"] * 3, ["1"] * 3, timeout=10, _score_fn=_raises) == [0.0] * 3
    assert verify_batch(["1"] * 2, ["1"] * 2, timeout=10, _score_fn=_crashes) == [0.0] * 2
    assert _delta(before) == {"timeouts": 0, "errors": 5}
    assert verify_batch(["3"], ["\\boxed{3}"]) == [1.0]


def test_idle_workers_are_not_timed_out():
    "A worker that sits idle past its last pair's deadline must not be counted as timed out, nor replaced."
    for _ in range(100):                                      # until every worker has started
        verify_batch(["1"] * 4, ["1"] * 4, timeout=5, _score_fn=_echo)
        if all(w.ready for w in V._POOL.workers): break
        time.sleep(0.1)
    n = len(V._POOL.workers)
    if n < 2: pytest.skip("needs two verifier processes")
    verify_batch(["1"] * n, ["1"] * n, timeout=0.3, _score_fn=_echo)   # every worker gets a pair and a deadline
    pids, before = _worker_pids(), reward_counters()
    time.sleep(0.5)                                           # now every deadline has passed
    assert verify_batch(["1"], ["1"], timeout=0.3, _score_fn=_echo) == [1.0]   # one worker busy, the others idle
    assert _delta(before) == {"timeouts": 0, "errors": 0}
    assert _worker_pids() == pids


def test_works_off_the_main_thread():
    out = {}
    def target(): out["scores"] = accuracy_reward(["q"], ["\\boxed{18}"], answer=["18"])
    t = threading.Thread(target=target); t.start(); t.join(30)
    assert out == {"scores": [1.0]}


def test_workers_that_cannot_start_raise_a_clear_error(monkeypatch):
    shutdown_verifier()
    monkeypatch.setattr(V, "_WORKER_START", "import sys; sys.exit(3)")
    with pytest.raises(RuntimeError, match="failed to start 3 times in a row"): verify_batch(["1"], ["1"])
    assert V._POOL is None
    monkeypatch.undo()
    assert verify_batch(["1"], ["\\boxed{1}"]) == [1.0]


def test_shutdown_and_restart():
    verify_batch(["1"], ["1"])
    pids = _worker_pids()
    shutdown_verifier()
    assert V._POOL is None and _gone_within(pids, 5)
    assert verify_batch(["1"], ["\\boxed{1}"]) == [1.0]


def _run_child(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, **kw)


CHILD = ("import mmrgrpo.rewards as V; V.verify_batch(['1'], ['1']); "
         "print(*[w.proc.pid for w in V._POOL.workers], flush=True)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_stop_when_the_interpreter_exits():
    start, child = time.perf_counter(), _run_child(CHILD)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and time.perf_counter() - start < 30
    assert _gone_within([int(p) for p in out.split()], 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_stop_when_the_trainer_is_killed():
    """Idle workers see their pipe close; a busy one (stuck in `_sleepy`) notices its parent is gone within a second or
    two."""
    child = _run_child("import sys; sys.path.insert(0, 'tests'); import test_rewards as T; " + CHILD
                       + "; V.verify_batch(['1'], ['1'], timeout=100, _score_fn=T._sleepy)")
    pids = [int(p) for p in child.stdout.readline().split()]
    time.sleep(2)                                             # a worker is now inside _sleepy
    child.send_signal(signal.SIGKILL); child.wait(10); child.stdout.close()
    assert pids and _gone_within(pids, 6)


# ---------------------------------------------------------------- reward functions

def test_accuracy_reward_accepts_strings_and_messages():
    completions = ["\\boxed{18}", [{"role": "assistant", "content": "\\boxed{17}"}],
                   [{"role": "assistant", "content": [{"type": "text", "text": "\\boxed{18}"}]}]]
    assert accuracy_reward(["q"] * 3, completions, answer=["18", 18, "18"], extra_column=[1, 2, 3]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("prompt,completion,expected", [
    ("p", "so \\boxed{4}.", 1.0), ("p", "$\\boxed{4}$", 1.0), ("p", "\\[ \\boxed{4} \\]\n", 1.0),
    ("p", "\\boxed{4} is it", 0.0), ("p", "\\boxed{ }", 0.0), ("p", "4", 0.0), ("p", "", 0.0), ("p", "\\boxed{4", 0.0),
    ("use <think> tags", "<think>2+2</think>\n\\boxed{4}", 1.0), ("use <think> tags", "\\boxed{4}", 0.0),
    ("use <think> tags", "<think>a</think>\\boxed{4}<think>b</think>", 0.0),
    ("use <think> tags", "<think>a<think>b</think>\\boxed{4}", 0.0),
    ("use <think> tags", "<think>\\boxed{4}</think>", 0.0),
    ("chat template\n<think>\n", "2+2=4</think> \\boxed{4}", 1.0),
    ("chat template\n<think>\n", "<think>2+2=4</think> \\boxed{4}", 0.0),
])
def test_format_reward(prompt, completion, expected):
    assert format_reward([prompt], [completion]) == [expected]
    assert format_reward([[{"role": "user", "content": prompt}]],
                         [[{"role": "assistant", "content": completion}]]) == [expected]


def test_format_reward_hostile_inputs_are_fast():
    start = time.perf_counter()
    assert format_reward(["<think>"] * len(HOSTILE), list(HOSTILE.values())) == [0.0] * len(HOSTILE)
    assert time.perf_counter() - start < 1.0


FRAGMENTS = ["\\boxed{", "\\boxed", "{", "}", "\\{", "\\\\", "\\frac{1}{2}", "42", "-3", "1,234", "<think>", "</think>",
             "$", "\\]", "\\(", " ", "\n", ".", "^", "x", "\\text{", "∞", "é", "\x00"]
hostile_text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=8), max_size=40).map("".join)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=hostile_text, completions=st.lists(hostile_text, min_size=1, max_size=3))
def test_fuzz_rewards_never_raise(prompt, completions):
    n = len(completions)
    start = time.perf_counter()
    boxed = [extract_boxed(c) for c in completions]
    fmt = format_reward([prompt] * n, completions)
    acc = accuracy_reward([prompt] * n, completions, answer=["42"] * n)
    assert time.perf_counter() - start < n * 2.0 + 10        # accuracy's time limit is 2 s per completion
    assert all(b is None or isinstance(b, str) for b in boxed)
    for scores in (fmt, acc):
        assert len(scores) == n and all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores)


# ---------------------------------------------------------------- compute_rewards and names

PROMPTS, COMPLETIONS, COLUMNS = ["p"] * 3, ["\\boxed{18}", "\\boxed{26}", "18 dollars"], {"answer": ["18"] * 3}


def nan_at_1(prompts, completions, **kw): return [0.5, float("nan"), 1.0]
def inf_at_2(prompts, completions, **kw): return [0.5, 1.0, -math.inf]
def text_at_0(prompts, completions, **kw): return ["1.0", 1.0, 1.0]
def one_short(prompts, completions, **kw): return [1.0] * (len(completions) - 1)
def returns_float(prompts, completions, **kw): return 1.0
def crashes(prompts, completions, **kw): raise KeyError("solution")
def needs_column(prompts, completions, solution, **kw): return [1.0] * len(completions)
def half_none(prompts, completions, **kw): return [None, 1, True]
def as_tensor(prompts, completions, **kw):
    import torch
    return torch.tensor([0.25] * len(completions))


@pytest.mark.parametrize("func,message", [
    (nan_at_1, "reward function 'nan_at_1' returned nan at index 1"),
    (inf_at_2, "reward function 'inf_at_2' returned -inf at index 2"),
    (text_at_0, "reward function 'text_at_0' returned '1.0' at index 0"),
    (one_short, "reward function 'one_short' returned 2 scores for 3 completions"),
    (returns_float, "reward function 'returns_float' returned 1.0 for 3 completions"),
    (crashes, "reward function 'crashes' raised KeyError: 'solution'"),
    (needs_column, "reward function 'needs_column' raised TypeError"),
])
def test_compute_rewards_raises_naming_the_function(func, message):
    with pytest.raises(RewardFunctionError) as e:
        compute_rewards([accuracy_reward, func], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_compute_rewards_weighted_total_and_metrics():
    import torch
    total, m = compute_rewards([accuracy_reward, format_reward, half_none], [1.0, 0.5, 2.0], PROMPTS, COMPLETIONS,
                               COLUMNS)
    assert total.dtype == torch.float32 and total.shape == (3,)
    assert total.tolist() == [1.5, 2.5, 3.0]
    assert m["rewards/accuracy_reward"] == pytest.approx(2 / 3)
    assert m["rewards/accuracy_reward_std"] == pytest.approx(torch.tensor([1.0, 0.0, 1.0]).std().item())
    assert m["rewards/half_none"] == pytest.approx(2 / 3) and m["rewards/half_none_none"] == 1
    assert m["rewards/format_reward_errors"] == 0 and m["rewards/timeouts"] == 0 and m["rewards/errors"] == 0


def test_compute_rewards_zero_on_error_counts():
    import torch
    funcs = [nan_at_1, one_short, crashes, functools.partial(inf_at_2), as_tensor]
    total, m = compute_rewards(funcs, None, PROMPTS, COMPLETIONS, COLUMNS, on_error="zero")
    assert torch.allclose(total, torch.tensor([0.5 + 0.5 + 0.25, 0.0 + 1.0 + 0.25, 1.0 + 0.0 + 0.25]))
    assert [m[f"rewards/{n}_errors"]
            for n in ["nan_at_1", "one_short", "crashes", "inf_at_2", "as_tensor"]] == [1, 3, 3, 1, 0]
    assert m["rewards/nan_at_1"] == pytest.approx(0.5)


def test_compute_rewards_logs_timeouts():
    before = reward_counters()
    total, m = compute_rewards([accuracy_reward], None, ["p"] * 2, [TOWER, "\\boxed{42}"], {"answer": ["42", "42"]})
    assert total.tolist() == [0.0, 1.0]
    assert m["rewards/timeouts"] == 1 and _delta(before)["timeouts"] == 1


def test_compute_rewards_argument_checks():
    with pytest.raises(ValueError, match="use 'raise' or 'zero'"):
        compute_rewards([half_none], None, PROMPTS, COMPLETIONS, {}, on_error="skip")
    with pytest.raises(ValueError, match="one weight per function"):
        compute_rewards([half_none], [1, 2], PROMPTS, COMPLETIONS, {})


def test_reward_names():
    assert reward_name(functools.partial(functools.partial(nan_at_1))) == "nan_at_1"
    _, m = compute_rewards([half_none, functools.partial(half_none)], None, PROMPTS, COMPLETIONS, {})
    assert "rewards/half_none_0" in m and "rewards/half_none_1" in m


def naps(prompts, completions, **kw): time.sleep(0.5); return [1.0] * len(completions)


def test_builtin_rewards_bound_their_own_time():
    """Ours (`has_own_time_limit`) are called directly, with their own limits; any other function gets `timeout` s per
    completion."""
    _, m = compute_rewards([accuracy_reward, format_reward, cosine_reward], None, PROMPTS, COMPLETIONS, COLUMNS,
                           timeout=1e-3)
    assert m["rewards/accuracy_reward"] == pytest.approx(2 / 3) and m["rewards/timeouts"] == 0
    with pytest.raises(RewardFunctionError, match=r"'naps' took more than 0.003 s for 3 completions"):
        compute_rewards([naps], None, PROMPTS, COMPLETIONS, COLUMNS, timeout=1e-3)


def test_get_reward_funcs():
    assert get_reward_funcs(["accuracy", "format", "cosine"]) == [accuracy_reward, format_reward, cosine_reward]
    assert get_reward_funcs(["test_rewards:half_none"])[0] is half_none
    with pytest.raises(ValueError, match=r"unknown reward function 'acuracy' \(did you mean 'accuracy'\?\)"):
        get_reward_funcs(["acuracy"])
    with pytest.raises(ValueError, match=r"function 'score': use 'accuracy'"): get_reward_funcs(["score"])  # no slip
    with pytest.raises(ValueError, match="cannot load reward function"): get_reward_funcs(["no_such_module_xyz:f"])
    with pytest.raises(ValueError, match="cannot load reward function"): get_reward_funcs(["math:nope"])
    with pytest.raises(ValueError, match="not a function"): get_reward_funcs(["math:pi"])
