"""The notebooks' live widgets in a real browser: JupyterLab on a local port, headless Chromium driven by playwright.

For notebooks 20_mmr, 21_pruning and 22_tokens: run every cell through JupyterLab, then move each slider and switch
each toggle of the `interact` view and check that its figure (or highlighted text) changes and that no traceback
appears anywhere. The notebooks run in a copy of nbs/ under the test's temporary folder, so nothing is written into the
repository; screenshots of every step are saved there too (`<tmp>/screenshots`). Skipped, with the reason, where
playwright or a Chromium is missing (`tools/install_browser.sh` installs Debian's `chromium`; `pip install -e ".[dev]"`
installs playwright).
Deselect with `-m "not browser"`.
"""
import json, os, re, secrets, shutil, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

NBS = Path(__file__).resolve().parents[1] / "nbs"
NOTEBOOKS = ["20_mmr.ipynb", "21_pruning.ipynb", "22_tokens.ipynb"]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
RUN_ALL_S, UPDATE_S = 240, 30  # bounds on running a whole notebook, and on one widget's redraw


def find_browser() -> str | None:
    "A Chromium executable: $MMRGRPO_CHROMIUM, else the first of `BROWSERS` on the PATH."
    exe = os.environ.get("MMRGRPO_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    return exe if exe and os.access(exe, os.X_OK) else None


def prepare_notebook(path: Path):
    """Outputs cleared (so every figure seen comes from this run) and the `nbdev_export()` cell dropped, as nbdev-test
    does."""
    nb = json.loads(path.read_text())
    nb["cells"] = [c for c in nb["cells"] if "nbdev_export()" not in "".join(c["source"])]
    for c in nb["cells"]:
        if c["cell_type"] == "code": c["outputs"], c["execution_count"] = [], None
    nb["metadata"].pop("widgets", None)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jupyter_dirs(root: Path) -> dict:
    "Private Jupyter folders: a `python3` kernel of this Python, and Lab settings that attach every cell to the page."
    dirs = {k: root / k.lower() for k in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                                          "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR", "IPYTHONDIR")}
    for d in dirs.values(): d.mkdir(parents=True)
    kernel = dirs["JUPYTER_DATA_DIR"] / "kernels" / "python3"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (mmrgrpo browser test)", "language": "python", "metadata": {"debugger": False}}))
    settings = {"notebook-extension/tracker": {"windowingMode": "none"},
                "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}
    for name, value in settings.items():
        f = dirs["JUPYTERLAB_SETTINGS_DIR"] / "@jupyterlab" / f"{name}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value))
    return {k: str(v) for k, v in dirs.items()}


def wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200: return
        except OSError: pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer at {url} within {timeout} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen):
    "SIGTERM the server (it shuts its kernels down); SIGKILL its process group (it leads one) if it lingers."
    if proc.poll() is not None: return
    proc.terminate()
    try: proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def shutdown_kernels(lab: dict):
    "Stop every kernel of our server (each notebook's kernel goes once its test is done: less memory for the next)."
    url, auth = f"{lab['base']}/api/kernels", {"Authorization": f"token {lab['token']}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=10) as r: kernels = json.load(r)
        for k in kernels:
            urllib.request.urlopen(urllib.request.Request(f"{url}/{k['id']}", headers=auth, method="DELETE"),
                                   timeout=30)
    except OSError: pass  # stopping the server stops them anyway


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    "JupyterLab serving a prepared copy of nbs/ on a free 127.0.0.1 port; stopped at the end whatever happens."
    try: import jupyterlab  # noqa: F401
    except ImportError: pytest.skip("jupyterlab is not installed (pip install -e '.[dev]')")
    root = tmp_path_factory.mktemp("widgets")
    nbs = root / "nbs"
    shutil.copytree(NBS, nbs, ignore=shutil.ignore_patterns("_proc", ".ipynb_checkpoints", "__pycache__"))
    for name in NOTEBOOKS: prepare_notebook(nbs / name)
    env = {**os.environ, **write_jupyter_dirs(root / "jupyter"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    port, token = free_port(), secrets.token_hex(16)
    log = root / "jupyterlab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={nbs}",
             "--ServerApp.allow_root=True", "--LabApp.expose_app_in_browser=True"],
            cwd=nbs, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_server(f"{base}/api/status?token={token}", proc, log)
        yield {"base": base, "token": token, "root": root, "log": log}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser():
    try: from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; its browser downloads are not needed)")
    exe = find_browser()
    if exe is None:
        pytest.skip(f"no Chromium found (looked for $MMRGRPO_CHROMIUM and {', '.join(BROWSERS)}): "
                    "run tools/install_browser.sh as root on Debian, or set MMRGRPO_CHROMIUM")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--disable-gpu", "--disable-dev-shm-usage"])
        try: yield b
        finally: b.close()


# --- JavaScript run in the page; `window.jupyterapp` is there because of --LabApp.expose_app_in_browser -----
PANEL = ("name => window.jupyterapp && Array.from(window.jupyterapp.shell.widgets('main'))"
         ".find(w => w.context && w.context.path === name)")

JS_READY = f"""name => {{ const p = ({PANEL})(name);
  return !!(p && p.context.isReady && p.sessionContext.session && p.sessionContext.session.kernel
            && p.sessionContext.session.kernel.connectionStatus === 'connected'
            && p.sessionContext.session.kernel.status === 'idle'); }}"""

JS_RUN_ALL = f"""name => {{ const p = ({PANEL})(name);
  window.jupyterapp.shell.activateById(p.id);
  window.jupyterapp.commands.execute('notebook:run-all-cells'); }}"""  # not awaited: the page polls for the end

# every code cell has run and the kernel is idle -- or an error output appeared, which ends the wait early
JS_RUN_DONE = f"""name => {{ const p = ({PANEL})(name);
  const cells = p.content.widgets.filter(c => c.model.type === 'code');
  const err = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
  return err || (cells.every(c => c.model.executionCount !== null)
                 && p.sessionContext.session.kernel.status === 'idle'); }}"""

# counts the kernel's turns to busy, so that a redraw is awaited only once the kernel has taken the widget's update
JS_COUNT_BUSY = f"""name => {{ const k = ({PANEL})(name).sessionContext.session.kernel;
  if (window.__busy === undefined) {{
    window.__busy = 0; k.statusChanged.connect((_, s) => {{ if (s === 'busy') window.__busy++; }}); }} }}"""

JS_STATE = f"name => [window.__busy, ({PANEL})(name).sessionContext.session.kernel.status]"

# error outputs of cells, plus any traceback rendered on the page (widget Output areas hold their errors outside the
# cells)
JS_ERRORS = f"""name => {{ const p = ({PANEL})(name);
  const out = [];
  for (const c of p.content.widgets) if (c.model.type === 'code')
    for (const o of c.model.outputs.toJSON()) if (o.output_type === 'error') out.push(o.ename + ': ' + o.evalue);
  for (const e of p.node.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
    if (/Traceback|Error:/.test(e.textContent)) out.push(e.textContent.slice(0, 2000));
  return out; }}"""

# what the view shows: the images' data and the rendered HTML/text (the token highlighting lives in the HTML)
JS_SHOWN = """el => { const o = el.querySelector('.widget-output');
  if (!o) return '';
  return Array.from(o.querySelectorAll('img')).map(i => i.src)
    .concat(Array.from(o.querySelectorAll('.jp-RenderedHTMLCommon, .jp-RenderedText')).map(e => e.innerHTML))
    .join('\\n'); }"""


def control_label(control) -> str:
    "The widget's description (a checkbox shows it beside the box, the others in a `.widget-label`)."
    for sel in (".widget-label", ".widget-label-basic"):
        lab = control.locator(sel).first
        # an empty label holds a zero-width space
        text = lab.inner_text().replace("\u200b", "").strip() if lab.count() else ""
        if text: return text
    return (control.get_attribute("class") or "control").split()[0]


def change(page, control) -> str:
    "Move a slider to the other end of its track, tick a checkbox, pick another toggle button or dropdown option."
    cls = control.get_attribute("class") or ""
    if "widget-slider" in cls:
        readout = control.locator(".widget-readout").first
        before = readout.inner_text()
        h, t = control.locator(".noUi-handle").first.bounding_box(), control.locator(".noUi-base").first.bounding_box()
        x0, y0 = h["x"] + h["width"] / 2, h["y"] + h["height"] / 2
        x1 = t["x"] + t["width"] * (0.2 if x0 > t["x"] + t["width"] / 2 else 0.8)
        page.mouse.move(x0, y0); page.mouse.down(); page.mouse.move(x1, y0); page.mouse.up()  # one jump: one redraw
        after = readout.inner_text()
        assert after != before, f"dragging the slider did not change its value ({before!r})"
        return f"slider {before} -> {after}"
    if "widget-checkbox" in cls:
        box = control.locator("input[type=checkbox]").first
        was = box.is_checked(); box.click()
        assert box.is_checked() != was, "clicking the checkbox did not tick/untick it"
        return f"checkbox {was} -> {not was}"
    if "widget-toggle-buttons" in cls:
        buttons = control.locator("button.widget-toggle-button").all()
        active = [b.inner_text() for b in buttons if "mod-active" in (b.get_attribute("class") or "")]
        other = next(b for b in buttons if "mod-active" not in (b.get_attribute("class") or ""))
        name = other.inner_text(); other.click()
        return f"toggle buttons {active} -> {name}"
    if "widget-dropdown" in cls:
        select = control.locator("select").first
        was = select.input_value()
        new = next(v for v in select.locator("option").evaluate_all("os => os.map(o => o.value)") if v != was)
        select.select_option(new)
        return f"dropdown {was} -> {new}"
    raise AssertionError(f"no way to operate a widget of class {cls!r}")


def settle(page, name: str, view, busy_before: int, timeout: float = UPDATE_S) -> tuple[str, bool]:
    """What the view shows once the kernel has taken the update (turned busy since `busy_before`), is idle again, and
    the view has stayed the same for half a second; and whether the kernel took an update at all within `timeout`."""
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        shown, (busy, status) = view.evaluate(JS_SHOWN), page.evaluate(JS_STATE, name)
        key = (shown, busy)
        if key != last: last, since = key, time.monotonic()
        elif busy > busy_before and status == "idle" and time.monotonic() - since > 0.5: return shown, True
        time.sleep(0.1)
    return last[0], last[1] > busy_before


def wait_js(page, js: str, arg, timeout: float, what: str, lab: dict):
    """Wait until `js` is true in the page; on a timeout, fail with a screenshot of the page and the end of the server
    log."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try: page.wait_for_function(js, arg=arg, timeout=timeout * 1000, polling=250)
    except PlaywrightTimeout:
        shot = lab["root"] / f"timeout_{int(time.time())}.png"
        page.screenshot(path=shot, full_page=True)
        pytest.fail(f"{arg or page.url}: waited {timeout} s for it {what}; page: {shot}\n"
                    f"server log:\n{lab['log'].read_text()[-3000:]}")


def check_no_errors(page, name: str, when: str):
    errors = page.evaluate(JS_ERRORS, name)
    assert not errors, f"{name}: error output {when}:\n" + "\n".join(errors)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_widgets_respond(browser, lab, name):
    """Every control of every `interact` view, moved in turn, redraws the view differently, without an error. A control
    whose effect another one hides in the current state (07: λ while `adaptive` is ticked) gets more rounds, after the
    others have moved on; switches go first, so that a slider that only acts with a switch off can act."""
    shots = lab["root"] / "screenshots"; shots.mkdir(exist_ok=True)
    stem, t0 = name.removesuffix(".ipynb"), time.monotonic()
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.set_default_timeout(30_000)
    try:
        page.goto(f"{lab['base']}/lab/workspaces/{stem}/tree/{name}?reset&token={lab['token']}")
        wait_js(page, JS_READY, name, 120, "to open with an idle kernel", lab)
        page.evaluate(JS_COUNT_BUSY, name)
        page.evaluate(JS_RUN_ALL, name)
        wait_js(page, JS_RUN_DONE, name, RUN_ALL_S, "to run all its cells", lab)
        check_no_errors(page, name, "after running all cells")
        print(f"{name}: opened and ran in {time.monotonic() - t0:.1f} s")

        views = page.locator(".widget-interact")
        wait_js(page, "() => document.querySelector('.widget-interact') !== null", None, UPDATE_S,
                "to show its widgets", lab)
        for v in range(views.count()):
            view = views.nth(v)
            shown, _ = settle(page, name, view, -1)
            assert shown, f"{name}: the interact view {v} shows nothing"
            view.screenshot(path=shots / f"{stem}_view{v}_0_initial.png")
            controls = view.locator(":scope > .widget-inline-hbox, :scope > .widget-toggle-buttons").all()
            pending = sorted(controls, key=lambda c: "widget-slider" in (c.get_attribute("class") or ""))
            assert pending, f"{name}: the interact view {v} has no controls"
            tried, step = {}, 0
            for _ in range(3):
                for control in list(pending):
                    label, step = control_label(control), step + 1
                    busy = page.evaluate(JS_STATE, name)[0]
                    control.scroll_into_view_if_needed()
                    try: what = change(page, control)
                    except AssertionError as e: pytest.fail(f"{name}: {label!r} does not respond to the mouse: {e}")
                    now, took = settle(page, name, view, busy)
                    path = shots / f"{stem}_view{v}_{step}_{re.sub(r'[^A-Za-z0-9_]+', '_', label)}.png"
                    view.screenshot(path=path)
                    check_no_errors(page, name, f"after moving {label!r} ({what})")
                    assert took, (f"{name}: moving {label!r} ({what}) sent the kernel nothing within {UPDATE_S} s; "
                                  f"see {path}")
                    tried.setdefault(label, []).append(f"{what}: {path.name}")
                    if now != shown: pending.remove(control)
                    shown = now
                if not pending: break
            if pending:
                pytest.fail(f"{name}: moving these controls never changed the view (screenshots in {shots}):\n"
                            + "\n".join(f"{k}: {tried[k]}" for k in map(control_label, pending)))
        print(f"{name}: done in {time.monotonic() - t0:.1f} s")
    finally:
        page.close()
        shutdown_kernels(lab)
