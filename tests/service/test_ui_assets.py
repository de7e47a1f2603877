"""The dashboard and /docs are served from the package's own files, and refer to no other host."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import anyio
import click
import httpx

from service import cli
from service.app import create_app
from service.models import JobState, NodeState
from service.routes.ui import UI_DIR
from service.settings import Settings

REPO = Path(__file__).resolve().parents[2]
# An absolute URL in a page the browser loads (a script, a stylesheet, an image).
ABSOLUTE = re.compile(r"""(?:src|href)\s*=\s*["'](?:https?:)?//""")


class Client:
    """GETs against the app in this process (no server, no etcd: these routes need neither)."""

    def __init__(self, tmp_path):
        self.app = create_app(Settings(log_root=str(tmp_path / "logs"), secret_dir=str(tmp_path / "s"),
                                       user_token="t"))

    def get(self, path: str) -> httpx.Response:
        async def get():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(self.app),
                                         base_url="http://ui.test") as c:
                return await c.get(path)
        return anyio.run(get)


def client(tmp_path) -> Client:
    return Client(tmp_path)


def test_root_and_ui_lead_to_the_dashboard_page(tmp_path):
    c = client(tmp_path)
    assert c.get("/").headers["location"] == "/ui/"
    assert c.get("/ui").headers["location"] == "/ui/"
    page = c.get("/ui/")
    assert page.status_code == 200 and not ABSOLUTE.search(page.text)
    assert re.search(r'"static/app\.js\?v=[0-9a-f]{12}"', page.text)  # a new version is fetched anew
    for asset in ("app.js", "marks.js", "app.css", "favicon.svg", "vendor/uplot/uPlot.iife.min.js"):
        assert c.get(f"/ui/static/{asset}").status_code == 200, asset


def test_docs_use_the_vendored_swagger_ui(tmp_path):
    c = client(tmp_path)
    html = c.get("/docs").text
    scripts = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert "/ui/static/vendor/swagger-ui/swagger-ui-bundle.js" in scripts
    assert all(s.startswith("/") and not s.startswith("//") for s in scripts), scripts
    for s in scripts:
        assert c.get(s).status_code == 200, s
    assert c.get("/redoc").status_code == 404  # redoc would load from a CDN: not served
    assert c.get("/openapi.json").status_code == 200


def test_every_file_of_the_dashboard_is_package_data():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["service"]
    package = UI_DIR.parent
    shipped = {p for g in globs for p in package.glob(g) if p.is_file()}
    on_disk = {p for p in UI_DIR.rglob("*") if p.is_file()}
    assert on_disk - shipped == set(), "add these to [tool.setuptools.package-data] in pyproject.toml"


# Markup the dashboard's policy would refuse: an inline script or style, a style attribute, an
# event-handler attribute (in the page, or in the HTML its script writes).
INLINE = re.compile(r"""<script(?![^>]*\bsrc=)[^>]*>|<style\b|\sstyle\s*=|\son[a-z]+\s*=\s*["']""", re.I)


def test_the_dashboard_runs_under_a_policy_of_its_own_files_that_no_site_may_frame(tmp_path):
    c = client(tmp_path)
    page = c.get("/ui/")
    policy = dict(p.strip().split(" ", 1) for p in page.headers["content-security-policy"].split(";"))
    assert policy["script-src"] == policy["style-src"] == policy["connect-src"] == "'self'"
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert page.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in c.get("/docs").headers["content-security-policy"]
    for source in ("index.html", "static/app.js", "static/marks.js"):
        assert not INLINE.search((UI_DIR / source).read_text()), source


# A command the dashboard tells a user to run: `<span class="mono">ftrain users add NAME</span>`.
NAMED_COMMAND = re.compile(r'class="mono">ftrain ([^<]+)<')


def test_every_command_the_dashboard_names_is_one_the_cli_has():
    named = [m for source in ("index.html", "static/app.js")
             for m in NAMED_COMMAND.findall((UI_DIR / source).read_text())]
    assert "users add NAME" in named
    for words in named:
        command = cli.main
        for word in words.split():
            if not isinstance(command, click.Group):
                break  # the rest are its arguments and options
            assert word in command.commands, f"the dashboard names `ftrain {words}`: no `{word}` command"
            command = command.commands[word]
        assert not isinstance(command, click.Group), f"`ftrain {words}` names a group, not a command"


def test_every_state_has_a_sign_and_a_look_of_its_own():
    script, css = (UI_DIR / "static/app.js").read_text(), (UI_DIR / "static/app.css").read_text()
    signs = dict(re.findall(r'\b([A-Z]+): "(.)"', script[script.index("const STATE_SIGN"):]))
    states = {s.value for s in (*JobState, *NodeState)}
    assert states <= signs.keys(), f"no sign for {states - signs.keys()}"
    assert signs["FAILED"] != signs["CANCELLED"]
    looks = {state: " ".join(re.findall(rf"\.state\.{state}\b[^{{]*\{{([^}}]*)\}}", css)) for state in states}
    assert all(looks.values()), [s for s, look in looks.items() if not look]
    assert looks["FAILED"] != looks["CANCELLED"]
