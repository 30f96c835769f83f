"""Inline views as a user sees them: real JupyterLab 4 and Notebook 7, in headless Chromium.

A notebook is executed with nbclient (as papermill does) and saved. One Jupyter server (JupyterLab
and Notebook 7 share it) serves it from a temporary root, with its settings, data and runtime
folders in the test's temporary folder, on 127.0.0.1 with a token. Notebooks open without a
kernel (``notebook_starts_kernel=False``) unless a test starts one first. Every request of the
browser outside the server is aborted and recorded; there must be none.

Checked: a saved notebook shows its views without a kernel, trusted and untrusted; with a new
kernel the widgets come back from the saved widget state, take the arrow keys before the
notebook's own shortcuts, and place their tooltips next to the hovered cell.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests._browser import hover_until, wait_until, watch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "attnviz-test-token"
APPS = ("lab", "notebook")  # JupyterLab 4, Notebook 7
TOKENS = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "warm",
          ".", "[SEP]"]
CELLS = [
    f"""import numpy as np, attnviz
from attnviz.capture import Capture
rng = np.random.default_rng(0)
weights = rng.dirichlet(np.full({len(TOKENS)}, 0.3), size=(3, 12, {len(TOKENS)}))
cap = Capture.from_attentions(weights.astype("float32"), {TOKENS!r}, model="toy",
                              text="the cat sat on the mat because it was warm.")""",
    """heat = attnviz.show(cap, view="heatmap", layer=1, head=2)
heat""",
    """attnviz.show(cap, view="model")""",
    """attnviz.show(cap, view="head", layer=2)""",
    """cap""",
    """import pathlib, tempfile
import transformers
transformers.utils.logging.disable_progress_bar()  # a progress bar is a widget of its own
from attnviz.long import load_long
from attnviz.notebook_long import show_long
from tests.long_fixtures import build_tiny_llama, capture_tiny_llama
work = pathlib.Path(tempfile.mkdtemp())
long_cap = load_long(capture_tiny_llama(build_tiny_llama(work / "llama", positions=512), 300,
                                        work / "capture"))
show_long(long_cap)""",
]
VIEWS = ["heatmap", "model", "head"]  # the views of cells 1-3, in order
COPIES = len(VIEWS) + 2  # static copies: the three views, the bare capture, the long view
LIVE_CHECK = """print("selected:", heat.layer, heat.heads)"""


@dataclass
class Server:
    """A running Jupyter server and the folders it was given."""

    url: str
    root: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Authorization": f"token {TOKEN}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _execute(folder: Path, env: dict[str, str]) -> Any:
    """Run CELLS with nbclient in a kernel of this interpreter; the notebook, executed."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(cell) for cell in CELLS]
    specs = KernelSpecManager(kernel_dirs=[str(folder / "share" / "jupyter" / "kernels")])
    manager = KernelManager(kernel_name="python3", kernel_spec_manager=specs)
    NotebookClient(notebook, km=manager, timeout=300, store_widget_state=True).execute(env=env)
    return notebook


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One Jupyter server for the module, serving the executed notebook (trusted and not)."""
    import nbformat
    from nbformat.sign import NotebookNotary

    home = tmp_path_factory.mktemp("jupyter")
    root = home / "root"
    root.mkdir()
    kernel = home / "share" / "jupyter" / "kernels" / "python3"
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (attnviz tests)", "language": "python"}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTER_PATH=str(home / "share" / "jupyter"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", MPLBACKEND="Agg", PYDEVD_DISABLE_FILE_VALIDATION="1",
               ATTNVIZ_CACHE_DIR=str(home / "cache"))
    notebook = _execute(home, env)
    nbformat.write(notebook, root / "views.ipynb")
    untrusted = nbformat.from_dict(json.loads(json.dumps(notebook)))
    untrusted.metadata["received_from"] = "someone else"  # another notebook: not signed
    nbformat.write(untrusted, root / "untrusted.ipynb")
    nbformat.write(notebook, root / "live.ipynb")  # a copy that a test runs in the browser
    (home / "data").mkdir()
    notary = NotebookNotary(data_dir=str(home / "data"))
    notary.sign(nbformat.read(root / "views.ipynb", as_version=4))
    port = _free_port()
    log = home / "server.log"
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}",
               f"--ServerApp.root_dir={root}", "--KernelSpecManager.ensure_native_kernel=False",
               "--LabServerApp.notebook_starts_kernel=False", "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    running = Server(f"http://127.0.0.1:{port}", root, env, process, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                running.api("GET", "/api/status")
                break
            except OSError:
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the Jupyter server did not start"
                time.sleep(0.25)
        yield running
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Opened:
    page: Any
    context: Any
    outside: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@pytest.fixture
def open_notebook(browser: Any, server: Server) -> Iterator[Any]:
    contexts: list[Any] = []

    def opener(app: str, name: str, width: int = 1280, height: int = 1000) -> Opened:
        context = browser.new_context(viewport={"width": width, "height": height})
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page, context)
        # Only the server, and what pages make themselves (data: images, blob: modules).
        watch(context, page, (server.url, "data:", "blob:", "about:"), opened.outside,
              opened.errors)
        path = f"/lab/tree/{name}?reset&token={TOKEN}" if app == "lab" else (
            f"/notebooks/{name}?token={TOKEN}")
        page.goto(server.url + path)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        return opened

    yield opener
    for context in contexts:
        context.close()




def _report_frames(opened: Opened, count: int) -> list[Any]:
    """The copies' frames, once each report in them has drawn (the notebook draws only what
    is on screen: each is scrolled to first)."""
    page = opened.page
    wait_until(page, "n => document.querySelectorAll('iframe.attnviz-report').length >= n", count)
    frames = []
    for index in range(count):
        element = page.locator("iframe.attnviz-report").nth(index)
        element.scroll_into_view_if_needed()
        frame = element.element_handle().content_frame()
        wait_until(frame, "document.documentElement.dataset.ready === '1'")
        frames.append(frame)
    return frames


def _visible_texts(page: Any, text: str) -> int:
    return page.evaluate(
        """t => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
                 .filter(e => e.offsetParent !== null && e.innerText.includes(t)).length""",
        text)


@pytest.mark.parametrize("app", APPS)
def test_saved_notebook_shows_its_views_without_a_kernel(open_notebook: Any, app: str) -> None:
    opened = open_notebook(app, "views.ipynb")
    page = opened.page
    frames = _report_frames(opened, len(VIEWS) + 1)  # three views and the bare capture
    # No kernel: the widget renderer can only wait ("Loading widget...") or fail ("model not
    # found"); the views' static copies show instead, and those placeholders are hidden.
    page.wait_for_timeout(1000)
    for text in ("Error displaying widget", "Loading widget", "model not found"):
        assert _visible_texts(page, text) == 0, text
    for frame, view in zip(frames, [*VIEWS, "head"]):
        assert frame.evaluate("window.attnvizReport.state.view") == view
        # Sized for its view: the heatmap and the model view do not scroll inside the frame.
        if view in ("heatmap", "model"):
            assert frame.evaluate("document.documentElement.scrollHeight <= innerHeight")
    heat = frames[0]
    assert "layer 1, head 2" in heat.get_attribute("#hm-canvas", "aria-label")
    assert heat.get_attribute("#hm-canvas", "data-scale") == "sqrt scale, top = max shown"
    assert heat.evaluate("document.getElementById('mv-grid').children.length") == 0
    assert frames[1].evaluate("document.querySelectorAll('#mv-grid canvas').length") == 36
    # The frames lie over the static images: the image is there but covered.
    covered = []
    for index in range(len(VIEWS) + 1):
        image = page.locator(".attnviz-static img").nth(index)
        image.scroll_into_view_if_needed()
        covered.append(image.evaluate("""img => { const r = img.getBoundingClientRect();
            const top = document.elementFromPoint(r.left + 10, r.top + 10);
            return top !== null && top.tagName === 'IFRAME'; }"""))
    assert covered == [True] * (len(VIEWS) + 1)
    # the long view's copy: the offline long report, drawn with its legend, no kernel
    long_frame = page.locator("iframe.attnviz-report").nth(len(VIEWS) + 1)
    long_frame.scroll_into_view_if_needed()
    frame = long_frame.element_handle().content_frame()
    wait_until(frame, "document.documentElement.dataset.longReady === '1' && "
                      "!document.getElementById('long-legend').hidden")
    assert frame.evaluate("document.getElementById('long-level').dataset.level") == "atlas"
    assert frame.evaluate("document.documentElement.scrollWidth <= innerWidth")
    assert opened.outside == []


@pytest.mark.parametrize("app", APPS)
def test_untrusted_notebook_shows_images_and_how_to_trust(open_notebook: Any, app: str) -> None:
    opened = open_notebook(app, "untrusted.ipynb")
    page = opened.page
    # The sanitizer strips the frames; the images and the note stay.
    wait_until(page, "n => document.querySelectorAll('.jp-OutputArea-output img').length >= n",
          COPIES)
    assert page.locator("iframe").count() == 0
    images = page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-OutputArea-output img')).map(img =>
             [img.complete && img.naturalWidth, img.getBoundingClientRect().height,
              img.getAttribute('alt')])""")
    assert len(images) == COPIES
    for width, height, alt in images:
        assert width > 200 and height > 100 and alt.startswith("attnviz")
    for index in range(COPIES):  # the notebook lays out the outputs on screen only
        page.locator(".jp-OutputArea-output img").nth(index).scroll_into_view_if_needed()
    notes = page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
                 .map(e => e.innerText).filter(t => t.includes('Trust Notebook'))""")
    assert len(notes) == COPIES
    assert "layer 1, head 2" in notes[0] and "every layer and head" in notes[1]
    assert "jupyter trust NOTEBOOK.ipynb" in notes[0]
    assert opened.outside == []


def _with_kernel(server: Server, name: str) -> None:
    """Start a new kernel for the notebook (as opening it with the default settings does)."""
    server.api("POST", "/api/sessions", {"path": name, "type": "notebook", "name": name,
                                        "kernel": {"name": "python3"}})


def _wait_connected(page: Any, server: Server, name: str, timeout_s: float = 90.0) -> None:
    """Wait until the page is connected to the notebook's kernel and the kernel is idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        sessions = [s for s in server.api("GET", "/api/sessions") if s["path"] == name]
        kernel = sessions and server.api("GET", f"/api/kernels/{sessions[0]['kernel']['id']}")
        if kernel and kernel["connections"] >= 1 and kernel["execution_state"] == "idle":
            return
        assert time.monotonic() < deadline, f"no page connected to the kernel: {kernel}"
        page.wait_for_timeout(250)


def _live_views(page: Any, count: int) -> None:
    wait_until(page, """n => Array.from(document.querySelectorAll('[data-attnviz-live]'))
                         .filter(e => e.dataset.ready === '1').length >= n""", count,
          timeout_s=90)


def _shadow(page: Any, index: int, expression: str) -> Any:
    return page.evaluate(
        f"""i => {{ const host = document.querySelectorAll('[data-attnviz-live]')[i];
                   const root = host.shadowRoot; return {expression}; }}""", index)


def _active_cell(page: Any) -> int:
    return int(page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell'))
                 .findIndex(c => c.classList.contains('jp-mod-active'))"""))


@pytest.mark.parametrize("app", APPS)
def test_new_kernel_restores_the_widgets_which_take_the_arrow_keys(
        open_notebook: Any, server: Server, app: str) -> None:
    _with_kernel(server, "views.ipynb")
    try:
        opened = open_notebook(app, "views.ipynb")
        page = opened.page
        _live_views(page, len(VIEWS))
        # The widgets are on the page: their static copies hide themselves. The long view's
        # widget has no object in the new kernel to answer it: its copy stays.
        # The notebook lays out its last cells (the bare capture, the long view) a moment
        # after the widgets are ready: wait for them, then check the count holds.
        shown = """() => Array.from(document.querySelectorAll('iframe.attnviz-report'))
                     .filter(f => f.offsetParent !== null).length"""
        wait_until(page, f"() => ({shown})() === 2", timeout_s=60)
        page.wait_for_timeout(500)
        assert page.evaluate(shown) == 2
        assert _shadow(page, 0, "root.getElementById('layer').value") == "1"  # position 1
        assert _shadow(page, 0, "root.querySelector('#heads .chip[aria-pressed=true]')"
                                ".textContent") == "2"
        host = page.locator("[data-attnviz-live]").first
        host.scroll_into_view_if_needed()
        x, y = _shadow(page, 0, """(() => { const r = root.querySelector('#view-heatmap .hint')
            .getBoundingClientRect(); return [r.left + 20, r.top + r.height / 2]; })()""")
        page.mouse.click(x, y)  # on the view's hint: the view takes the focus
        assert _shadow(page, 0, "root.activeElement !== null")
        before = _active_cell(page)
        page.keyboard.press("ArrowDown")
        page.keyboard.press("ArrowRight")
        # The view moved (layer 1 -> 2, head 2 -> 3); the notebook's active cell did not.
        wait_until(page, """() => {
            const root = document.querySelectorAll('[data-attnviz-live]')[0].shadowRoot;
            return root.getElementById('hm-canvas').getAttribute('aria-label')
                       .includes('layer 2, head 3'); }""")
        assert _active_cell(page) == before
        assert opened.outside == []
    finally:
        for session in server.api("GET", "/api/sessions"):
            server.api("DELETE", f"/api/sessions/{session['id']}")


@pytest.mark.parametrize("app", APPS)
def test_tooltips_land_next_to_the_hovered_cell(open_notebook: Any, server: Server,
                                               app: str) -> None:
    _with_kernel(server, "views.ipynb")
    try:
        opened = open_notebook(app, "views.ipynb", height=900)
        page = opened.page
        _live_views(page, len(VIEWS))
        host = page.locator("[data-attnviz-live]").first
        host.scroll_into_view_if_needed()
        def layout() -> list[float]:
            return _shadow(page, 0, """(() => { const c = root.getElementById('hm-canvas');
                const r = c.getBoundingClientRect();
                return [r.left, r.top, Number(c.dataset.x0), Number(c.dataset.y0),
                        Number(c.dataset.cell), Number(c.dataset.n)]; })()""")

        n = int(layout()[5])
        pointer: list[float] = []
        for row, col in [(0, 0), (n - 1, n - 1), (n // 2, 3)]:

            def centre(row: int = row, col: int = col) -> tuple[float, float]:
                # read on every try: the notebook may re-lay the view out between reads
                left, top, x0, y0, cell, _ = layout()
                pointer[:] = [left + x0 + (col + 0.5) * cell, top + y0 + (row + 0.5) * cell]
                return pointer[0], pointer[1]

            hover_until(page, centre, lambda row=row, col=col: page.evaluate("""([r, c]) => {
                const t = document.querySelectorAll('[data-attnviz-live]')[0].shadowRoot
                    .getElementById('tooltip');
                return !t.hidden && t.dataset.query === String(r) && t.dataset.key === String(c);
            }""", [row, col]), what=f"the tooltip of query {row}, key {col}")
            x, y = pointer
            tip = _shadow(page, 0, """(() => { const r = root.getElementById('tooltip')
                .getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })()""")
            view = host.bounding_box()
            # Next to the pointer (within a tooltip's width and 40 px), inside the view's box.
            assert tip[0] - 40 <= x <= tip[2] + 40 and tip[1] - 40 <= y <= tip[3] + 40, (tip, x, y)
            assert not (tip[0] <= x <= tip[2] and tip[1] <= y <= tip[3])  # not under it
            assert view["x"] <= tip[0] and tip[2] <= view["x"] + view["width"] + 1
            assert view["y"] <= tip[1] and tip[3] <= view["y"] + view["height"] + 1
        # The head view of all 12 heads: every head's section shows, beside the token.
        head_view = page.locator("[data-attnviz-live]").nth(2)
        head_view.scroll_into_view_if_needed()
        token: list[float] = []

        def token_left() -> tuple[float, float]:
            token[:] = _shadow(page, 2, """(() => {
                const t = root.querySelector('#hv-left .tok[data-i="6"]').getBoundingClientRect();
                return [t.left + 5, t.top + t.height / 2]; })()""")
            return token[0], token[1]

        hover_until(page, token_left, lambda: page.evaluate(
            """() => { const t = document.querySelectorAll('[data-attnviz-live]')[2]
            .shadowRoot.getElementById('tooltip');
            return !t.hidden && t.dataset.index === '6'; }"""), what="the head view's tooltip")
        heads = _shadow(page, 2, """Array.from(root.querySelectorAll('#tooltip th'))
            .map(th => th.textContent)""")
        assert heads == ["mean of selected heads"] + [f"head {h}" for h in range(12)]
        tip = _shadow(page, 2, """(() => { const r = root.getElementById('tooltip')
            .getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })()""")
        view = head_view.bounding_box()
        assert view["x"] <= tip[0] and tip[2] <= view["x"] + view["width"] + 1
        assert view["y"] <= tip[1] and tip[3] <= view["y"] + view["height"] + 1
        assert tip[1] - 40 <= token[1] <= tip[3] + 40
        assert tip[3] <= page.viewport_size["height"]
        assert opened.outside == []
    finally:
        for session in server.api("GET", "/api/sessions"):
            server.api("DELETE", f"/api/sessions/{session['id']}")


@pytest.mark.parametrize("app", APPS)
def test_running_notebook_shows_the_live_widget_only(open_notebook: Any, server: Server,
                                                     app: str) -> None:
    _with_kernel(server, "live.ipynb")
    try:
        opened = open_notebook(app, "live.ipynb")
        page = opened.page
        _wait_connected(page, server, "live.ipynb")
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.click("[data-command='runmenu:run-all']")
        # The saved widgets (disconnected) give way to live ones, connected to the kernel.
        wait_until(page, """n => Array.from(document.querySelectorAll('[data-attnviz-live]'))
                 .filter(e => e.dataset.ready === '1'
                              && !e.classList.contains('jupyter-widgets-disconnected'))
                 .length >= n""", len(VIEWS), timeout_s=120)
        # the long view's widget goes live once the kernel answers it
        long_host = page.locator(".jp-Cell").nth(len(CELLS) - 1)
        long_host.scroll_into_view_if_needed()
        wait_until(page, "n => document.querySelectorAll('[data-attnviz-live]').length >= n",
                   len(VIEWS) + 1, timeout_s=180)
        # Live: the widgets show and their static copies hide themselves (the bare capture's
        # copy, without a key, is its only view). The notebook renders the cells on screen.
        for index in range(len(VIEWS)):
            page.locator("[data-attnviz-live]").nth(index).scroll_into_view_if_needed()
            shown = page.evaluate("""() => Array.from(document.querySelectorAll(
                '[data-attnviz-static] iframe')).map(f => f.offsetParent !== null)""")
            assert shown and not any(shown)
        for text in ("Error displaying widget", "Loading widget"):
            assert _visible_texts(page, text) == 0
        # A click in the view reaches Python: shift-click head 5, then ask the kernel.
        host = page.locator("[data-attnviz-live]").first
        host.scroll_into_view_if_needed()
        x, y = _shadow(page, 0, """(() => { const r = root.querySelector(
            '#heads .chip[data-head="5"]').getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; })()""")
        page.keyboard.down("Shift")
        page.mouse.click(x, y)
        page.keyboard.up("Shift")
        wait_until(page, """() => document.querySelectorAll('[data-attnviz-live]')[0].shadowRoot
                 .getElementById('hm-canvas').getAttribute('aria-label').includes('head 5')""")
        # A cell of our own at the end prints what Python holds.
        page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-InputPrompt").click()
        page.keyboard.press("b")
        page.keyboard.press("Enter")
        page.keyboard.type(LIVE_CHECK)
        page.keyboard.press("Shift+Enter")
        wait_until(page, """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
                 .some(e => e.innerText.includes('selected: 1 [5]'))""")
        assert opened.outside == []
    finally:
        for session in server.api("GET", "/api/sessions"):
            server.api("DELETE", f"/api/sessions/{session['id']}")
