"""The web dashboard (`/ui`) and the API docs (`/docs`), served from files in the package.

Every asset is shipped (`service/ui/`, listed as package data in pyproject.toml): the
dashboard is one page (`index.html`, `app.js`, `marks.js`, `app.css`) that calls the same REST
API as the CLI, with the token the user signs in with (kept in the browser's sessionStorage,
sent as `Authorization: Bearer`); its charts are uPlot's and `/docs` is Swagger UI's, both vendored
unmodified under `static/vendor/` (versions and licences in its README). Nothing is fetched
from another host, so both work on a cluster with no Internet access. The pages themselves
need no token: the data does.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
STATIC = "/ui/static"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui")
async def ui_no_slash() -> RedirectResponse:
    return RedirectResponse("/ui/")


@functools.cache
def index_html() -> str:
    """The page, its own assets named with a digest of their content (`app.js?v=...`), so a
    browser that cached an older version's script does not run it against a newer server."""
    page = (UI_DIR / "index.html").read_text()
    for asset in ("static/app.js", "static/marks.js", "static/app.css"):
        digest = hashlib.sha256((UI_DIR / asset).read_bytes()).hexdigest()[:12]
        page = page.replace(f'"{asset}"', f'"{asset}?v={digest}"')
    return page


# The dashboard runs its own files only: no inline script or style (an injected `<script>` or
# `onerror=` does not run), data from this origin only (a token cannot be sent elsewhere), and
# no other site may frame it (clickjacking its cancel and drain buttons). uPlot and the page's
# script (progress bars, the marks on a job's curves) set styles through the DOM's style
# properties, which the policy allows; a `style=` attribute in HTML it would refuse.
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                 "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
                 "frame-ancestors 'none'")
NOT_FRAMED = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
              "Referrer-Policy": "no-referrer"}


@router.get("/ui/")
async def ui() -> HTMLResponse:
    return HTMLResponse(index_html(), headers={"Cache-Control": "no-cache",
                                               "Content-Security-Policy": DASHBOARD_CSP, **NOT_FRAMED})


@router.get("/docs")
async def docs() -> HTMLResponse:
    # Swagger UI's page starts it with an inline script: framed by no one, like the dashboard.
    page = get_swagger_ui_html(
        openapi_url="/openapi.json", title="ftrain API",
        swagger_js_url=f"{STATIC}/vendor/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{STATIC}/vendor/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{STATIC}/favicon.svg")
    page.headers.update({"Content-Security-Policy": "frame-ancestors 'none'", **NOT_FRAMED})
    return page


def install(app: FastAPI) -> None:
    """Serve the dashboard and `/docs` on `app` (whose own docs and redoc are off)."""
    app.include_router(router)
    app.mount(STATIC, StaticFiles(directory=UI_DIR / "static"), name="ui-static")
