"""Run a notebook from top to bottom in a kernel of this Python, as "Run all" does, and fail on the first error.

    python tools/run_notebook.py NOTEBOOK [--cwd DIR] [--colab HOME] [--replace OLD NEW] [--save OUT]

The kernel starts in DIR (default: the notebook's own folder). --colab HOME runs it as a fresh Colab runtime would,
alone: `import google.colab` succeeds (a stand-in module), the kernel's home is HOME and it starts in HOME/content, an empty
folder, as Colab's in /content; pip keeps its cache and the model hub is out of reach (HF_HUB_OFFLINE=1), as here.
--replace rewrites OLD to NEW in the code cells first (the Colab simulation points the repository's URL at a local
clone). The notebook file itself is never changed; --save writes the executed copy to OUT. Every cell runs, whatever its
nbdev flags: what a user runs is what is checked."""
import argparse, os, subprocess, sys, time
from pathlib import Path
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def as_on_colab(home: Path) -> Path:
    "Set this process's environment (the kernel inherits it) as on a fresh Colab runtime; the folder to start in."
    stand_in = home / "colab_module"
    (stand_in / "google" / "colab").mkdir(parents=True, exist_ok=True)     # `google`: a namespace, as protobuf's is
    (stand_in / "google" / "colab" / "__init__.py").write_text('"Colab\'s own module, stood in for."\n')
    pip_cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout
    os.environ.update(HOME=str(home), PYTHONPATH=str(stand_in), HF_HUB_OFFLINE="1",
                      PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if pip_cache.strip(): os.environ["PIP_CACHE_DIR"] = pip_cache.strip()
    (home / "content").mkdir(parents=True, exist_ok=True)
    return home / "content"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--cwd", type=Path, default=None)
    ap.add_argument("--colab", type=Path, default=None, metavar="HOME")
    ap.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"))
    ap.add_argument("--save", type=Path, default=None)
    ap.add_argument("--show", action="store_true", help="print what each cell printed (40 lines at most a cell)")
    a = ap.parse_args()
    nb = nbformat.read(a.notebook, as_version=4)
    for old, new in a.replace:
        hits = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        if not hits: sys.exit(f"run_notebook: {old!r} is in no code cell of {a.notebook}")
        for c in hits: c.source = c.source.replace(old, new)
    cwd = (a.cwd or (as_on_colab(a.colab.resolve()) if a.colab else a.notebook.parent)).resolve()
    start = time.perf_counter()
    client = NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    try: client.execute()
    except CellExecutionError as e:
        sys.exit(f"run_notebook: {a.notebook} failed after {time.perf_counter() - start:.0f} s:\n{e}")
    finally:
        if a.save: nbformat.write(nb, a.save)
    if a.show:
        for c in nb.cells:
            text = "".join(o.get("text", "") for o in c.get("outputs", []) if o.get("output_type") == "stream")
            for line in text.splitlines()[:40]: print(f"  | {line[:160]}")
    print(f"run_notebook: {a.notebook} ran in {time.perf_counter() - start:.0f} s ({len(nb.cells)} cells)")


if __name__ == "__main__":
    main()
