"""Reward functions the reliability tests load by name, `reward_fixtures:<function>`: one that varies within a group (so
advantages and updates are not zero on a random model), and three that misbehave in the three ways the trainer must survive."""
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
