"""Reward functions the reliability tests load by name, `reward_fixtures:<function>`: one that varies within a group (so
advantages and updates are not zero on a random model), and three that misbehave in the three ways the trainer must
survive."""
import math


def varied(prompts, completions, **kwargs):
    "A deterministic reward that differs between completions of a group: the completion's length mod 3."
    return [float(len(c) % 3) for c in completions]


def raises(prompts, completions, **kwargs):
    "A reward function with a bug."
    raise RuntimeError(f"cannot score completion 2 of {len(completions)}")


def wrong_length(prompts, completions, **kwargs):
    "One score short."
    return [1.0] * (len(completions) - 1)


def nan_at_2(prompts, completions, **kwargs):
    "1.0 everywhere except a NaN for the completion at index 2."
    return [math.nan if i == 2 else 1.0 for i in range(len(completions))]


def sleeps(prompts, completions, **kwargs):
    "A reward function that hangs (30 s): the time limit must cut it off."
    import time
    time.sleep(30)
    return [0.0] * len(completions)


def exits(prompts, completions, **kwargs):
    "A reward function that ends the interpreter (a stray `sys.exit(0)` in a helper)."
    raise SystemExit(0)


def mutates(prompts, completions, **kwargs):
    "A reward function that changes what it was given: later functions, MMR and the completions table must not see it."
    completions[:] = ["changed"] * len(completions)
    for v in kwargs.values():
        if isinstance(v, list): v.clear()
    return [0.0] * len(prompts)


def sends_sigint(prompts, completions, **kwargs):
    "The user's Ctrl-C arrives while the reward functions run (sent here, so it comes at that moment)."
    import os, signal
    # called in its own process, or not
    trainer = os.getppid() if os.environ.get("MMRGRPO_FUNCTION_PROCESS") else os.getpid()
    os.kill(trainer, signal.SIGINT)
    return varied(prompts, completions)


def _term_trainer_then_score(gold, completion):
    """Run in a verifier process: for the gold 'term', send SIGTERM to the trainer's process group (a scheduler stopping
    the job)."""
    import os, signal, time
    if gold == "term": os.killpg(os.getpgid(os.getppid()), signal.SIGTERM); time.sleep(0.5)
    return 1.0


def holds_the_interpreter(prompts, completions, **kwargs):
    """A backtracking regular expression: it holds the interpreter (the GIL) for about 20 s on a laptop, then scores
    like `varied`."""
    import re
    re.match(r"(a+)+$", "a" * 28 + "b")
    return varied(prompts, completions)


_CALLS = {"fails_second": 0}


def fails_second(prompts, completions, **kwargs):
    "A reward function with a bug that shows at its second call (step 2): step 1 is trained by then."
    _CALLS["fails_second"] += 1
    if _CALLS["fails_second"] == 2: raise RuntimeError("cannot score this batch")
    return varied(prompts, completions)


def forks(prompts, completions, **kwargs):
    "A reward function that forks (as a library may): its child returns scores of 100, its parent `varied`'s."
    import os
    return [100.0] * len(completions) if os.fork() == 0 else varied(prompts, completions)


def clipped(prompts, completions, bounds=(0.0, 1.0), **kwargs):
    "A reward function with a setting of its own, `bounds`, that a data column of that name must not replace."
    low, high = bounds
    return [min(max(float(len(c) % 3), low), high) for c in completions]
