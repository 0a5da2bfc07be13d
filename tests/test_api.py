"The public API: the names a user needs at the top of the package, and the reward functions where their name says."
import subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(code: str) -> subprocess.CompletedProcess:
    "Run `code` in a fresh interpreter that imports this checkout, so no earlier import hides a circle."
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def test_the_readme_import_line_works():
    r = run("import mmrgrpo; mmrgrpo.train; mmrgrpo.GRPOConfig; "
            "from mmrgrpo.rewards import accuracy_reward, format_reward")
    assert r.returncode == 0, r.stderr


def test_every_public_name_resolves():
    r = run("import mmrgrpo; missing = [n for n in mmrgrpo.__all__ if getattr(mmrgrpo, n, None) is None]; "
            "print(missing)")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_old_home_of_the_rewards_still_works():
    r = run("import mmrgrpo.rewards as R, mmrgrpo.verifier_pool as V; "
            "assert V.accuracy_reward is R.accuracy_reward and V.get_reward_funcs is R.get_reward_funcs")
    assert r.returncode == 0, r.stderr


def test_importing_the_package_loads_no_module_of_its_own():
    r = run("import sys, mmrgrpo; print(sorted(m for m in sys.modules if m.startswith('mmrgrpo.')))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_an_unknown_name_says_so():
    r = run("import mmrgrpo; mmrgrpo.trian")
    assert "has no attribute 'trian'" in r.stderr


def test_the_readme_is_one_page_and_names_no_commit():
    "README under 10,000 characters, no commit hash; `.ci/run` runs exactly its test command."
    import re
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 10_000, len(readme)
    assert not re.findall(r"`[0-9a-f]{7,40}`|commit [0-9a-f]{7}", readme)
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert blocks[1] in (ROOT / ".ci" / "run").read_text() and blocks[1].endswith("bash tools/test.sh")


def test_evaluate_is_the_function_after_the_trainer_imports():
    "The README calls `mmrgrpo.evaluate` after `mmrgrpo.train`; no submodule of that name may shadow the function."
    r = run("import mmrgrpo; mmrgrpo.train; import mmrgrpo.trainer; "
            "from mmrgrpo.evaluation import evaluate; assert mmrgrpo.evaluate is evaluate, mmrgrpo.evaluate")
    assert r.returncode == 0, r.stderr


def test_no_public_name_is_a_module():
    "Every public name is a function, class or value, never a submodule that shadows it once imported."
    r = run("import importlib, types, mmrgrpo; "
            "[importlib.import_module('mmrgrpo.' + m) for m in set(mmrgrpo._PUBLIC.values())]; "
            "print([n for n in mmrgrpo.__all__ if isinstance(getattr(mmrgrpo, n), types.ModuleType)])")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_readme_python_runs_and_replaces_no_run(tmp_path):
    """The README's "From Python" block, run as written on a tiny copy of configs/demo.yaml: it trains, evaluates on the
    prompts it trained on (its worked example included), and training again stops instead of replacing the run."""
    import re, yaml
    block = re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)[0]
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    demo.update(model="tiny-random", steps=1, prompts_per_step=2, num_generations=4, max_completion_length=6,
                eval_size=2, eval_every=1, save_every=1, log_completions_every=0)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text(yaml.safe_dump(demo))
    after = ("\nassert prompts[0].count('What is') == 2, prompts[0]   # the worked example's question, then ours"
             "\ntry: mmrgrpo.train(config)\nexcept Exception as e: print('second run:', e)"
             "\nelse: print('second run: trained')")
    r = subprocess.run([sys.executable, "-c", block + after], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "second run:" in r.stdout and "resume_from=latest" in r.stdout, r.stdout[-3000:]
    assert (tmp_path / "runs" / "mine").is_dir()
