"""Quality reports in the Airflow UI: a nav entry and the app that serves the reports folder.

Airflow 3 plugin (``fastapi_apps`` + ``external_views``): the FastAPI app below is mounted by
the API server under ``/clickstream-reports/`` and serves ``$CLICKSTREAM_HOME/reports``
(``index.html``, Great Expectations Data Docs, backfill and correction reports), read-only.
The "Quality reports" entry in the UI navigation shows it inside the Airflow UI.

Only logged-in users see it: every request goes through Airflow's own user check (the JWT in
the ``Authorization: Bearer`` header, or the UI's ``_token`` session cookie). Without it, an
API client gets 401 (403 for an invalid token) and a browser is sent to the login page. A
logged-in user also needs the auth manager's leave to see the "Quality reports" view: without
it, 403 (a short page saying so for a browser: the login page would only lead back here).

It also shows where the read point stands (``read-point``, a second nav entry): which table
versions readers are sent to, and what holds a client back.

Known edge cases, cited inline as (Q1)..(Q4):
  Q1. The folder is resolved per request from ``CLICKSTREAM_HOME`` (never at import), and a
      missing or empty folder gives a friendly page, not an error.
  Q2. Paths are resolved (``..``, symlinks) and must stay inside the reports folder; anything
      else is a 404, so the app never serves other files of the machine.
  Q3. A folder without ``index.html`` is listed; folder URLs end with ``/`` so the relative
      links of reports (Data Docs use them) resolve inside the folder.
  Q4. No script runs on a served page (``script-src 'none'``): GX Data Docs pages load ~9
      scripts from public CDNs, three of them unpinned (``vega@5``...), which would run on
      Airflow's origin as the logged-in user. The pages keep their styles and every result;
      only their JavaScript (sortable and filterable tables, charts) is off.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
)

URL_PREFIX = "/clickstream-reports"
VIEW_NAME = "Quality reports"  # the nav entry, and the resource auth managers grant
READ_POINT_PATH = "read-point"  # no report has this name: the read point's page
HEADERS = {"X-Content-Type-Options": "nosniff",
           # (Q4) Styles (inline and from CDNs) stay allowed: our pages and GX's need them.
           "Content-Security-Policy": "frame-ancestors 'self'; script-src 'none'; "
                                      "object-src 'none'",
           "Cache-Control": "no-store"}


class NotPermitted(HTTPException):
    """A logged-in user the auth manager does not let see the view: 403 for a browser too,
    where a login failure sends it to the login page."""


async def require_login(request: Request) -> object:
    """Airflow's authenticated user of this request, or HTTP 401/403; 403 too for a user the
    auth manager does not let see this view (a role without it, in FAB or Keycloak): a login
    alone let any user read every client's reports."""
    # Imported here, not at module level: every Airflow component imports plugins, and
    # only the API server needs the API's security module.
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user

    credentials = await bearer_scheme(request)
    user = await get_user(request, None, credentials)
    if not get_auth_manager().is_authorized_custom_view(method="GET", resource_name=VIEW_NAME,
                                                        user=user):
        raise NotPermitted(403, f"this user may not see {VIEW_NAME!r}; ask an Airflow admin "
                                "to grant that view to the user's role")
    return user


def reports_root() -> Path:
    """``$CLICKSTREAM_HOME/reports``, resolved now (Q1)."""
    return (_setting("home") / "reports").resolve()


def _setting(name: str) -> Any:
    """``Config``'s value of one setting from its variable alone (Q1): a malformed setting
    the pages do not use made every page an opaque 500."""
    from clickstream.config import ENV_NAMES, Config

    variable = ENV_NAMES[name]
    return getattr(Config.from_env({variable: os.environ[variable]}
                                   if variable in os.environ else {}), name)


def read_point_page() -> HTMLResponse:
    """Where the read point stands and what holds a client back (``io.read_point``)."""
    from clickstream.config import Config
    from clickstream.io import read_point

    config = Config().replace(warehouse=_setting("warehouse"))
    point = read_point.current(config)
    title = "Read point"
    if point is None:
        return _page(title, "<p>No read point yet: the first writer's commits write it "
                     f"(<code>{html.escape(str(read_point.folder(config)))}</code>).</p>")
    cells = "".join(f"<tr><td>{html.escape(name)}</td><td>{version}</td></tr>"
                    for name, version in point.versions.items())
    body = (f"<p>Written {html.escape(point.written_at)}. Readers read each table at its "
            "version; a held client at its own (<code>clickstream read-point</code> prints "
            f"them as JSON).</p><table><tr><th>table</th><th>version</th></tr>{cells}</table>")
    groups = read_point.describe_open_groups(config)
    if groups:
        items = "".join(f"<li>{html.escape(group)}</li>" for group in groups)
        body += ("<h2>Held back</h2><p>Each open group keeps its client (a micro-batch of the "
                 "sessionizer: every client) where it was until its commits are all made. A "
                 "group that stays open was stopped part way: rerun it (a backfill, the "
                 "sessionizer), or give it up with <code>clickstream read-point --release "
                 f"GROUP</code>.</p><ul>{items}</ul>")
    else:
        body += "<p>Nothing held back: every client is read at these versions.</p>"
    return _page(title, body)


def _page(title: str, body: str, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(
        "<!doctype html><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:60em}li{margin:.3em 0}"
        "code{background:#f3f3f3;padding:0 .2em}</style>"
        f"<h1>{html.escape(title)}</h1>{body}\n", status_code=status_code, headers=HEADERS)


def _no_reports(title: str, folder: Path) -> HTMLResponse:
    return _page(title, (
        "<p>No reports yet. They appear here as soon as data-quality gates, backfills "
        "and recomputes write them.</p>"
        f"<p>Folder: <code>{html.escape(str(folder))}</code> "
        "(<code>$CLICKSTREAM_HOME/reports</code>).</p>"))


def _link_to(entry: Path) -> str:
    """A relative link to ``entry`` that stays one: a name such as ``javascript:x`` or one
    holding ``#`` or ``?`` must not become a script, an anchor or a query."""
    return html.escape("./" + quote(entry.name) + ("/" if entry.is_dir() else ""))


def _listing(folder: Path, root: Path) -> HTMLResponse:
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    relative = folder.relative_to(root).as_posix()
    title = "Quality reports" + ("" if relative == "." else f": {relative}")
    if not entries:
        return _no_reports(title, folder)
    items = "".join(
        f"<li><a href='{_link_to(p)}'>{html.escape(p.name)}{'/' if p.is_dir() else ''}</a></li>"
        for p in entries)
    up = "" if folder == root else "<p><a href='../'>&larr; up</a></p>"
    return _page(title, f"{up}<ul>{items}</ul>")


def _inside(root: Path, path: Path) -> Path | None:
    """``path`` resolved, or None when it leaves ``root`` or cannot name a file (Q2)."""
    try:
        resolved = path.resolve()
        resolved.exists()  # a name too long for the system raises here, not in resolve()
    # A NUL byte, a name too long: no report; nor a symlink loop (RuntimeError before 3.13).
    except (OSError, ValueError, RuntimeError):
        return None
    return resolved if resolved == root or root in resolved.parents else None


def create_app() -> FastAPI:
    app = FastAPI(title="Clickstream quality reports", docs_url=None, redoc_url=None,
                  openapi_url=None, dependencies=[Depends(require_login)])

    @app.exception_handler(HTTPException)
    async def login_first(request: Request, error: HTTPException) -> Response:
        wants_page = "text/html" in request.headers.get("accept", "")
        if wants_page and isinstance(error, NotPermitted):
            reason = html.escape(error.detail, quote=False)
            return _page("Not allowed", f"<p>{reason[:1].upper()}{reason[1:]}.</p>", 403)
        # No login, an expired or an invalid token (401/403): log in, then come back.
        if error.status_code in (401, 403) and wants_page:
            from airflow.api_fastapi.app import get_auth_manager

            # Back to this page by its path: a full URL would take its host from the request's
            # Host header, which a proxy may pass on as the client sent it.
            back = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            login = get_auth_manager().get_url_login(next_url=back)
            return RedirectResponse(login, status_code=303)
        return JSONResponse({"detail": error.detail}, status_code=error.status_code,
                            headers=error.headers)

    @app.get(f"/{READ_POINT_PATH}", response_model=None)
    def show_read_point() -> Response:
        from clickstream.errors import ClickstreamError

        try:
            return read_point_page()
        except ClickstreamError as refused:  # a refused setting, an unreadable file
            return _page("Read point unavailable", f"<p>{html.escape(str(refused))}</p>", 500)

    @app.get("/{path:path}", response_model=None)
    def serve(path: str, request: Request) -> Response:
        from clickstream.errors import ConfigError

        try:
            root = reports_root()
        except ConfigError as refused:  # an opaque 500 otherwise, on every page
            return _page("Quality reports unavailable", "<p>The reports folder's setting is "
                         f"refused: {html.escape(str(refused))}</p>", 500)
        if not root.is_dir():
            return _no_reports("Quality reports", root)
        target = _inside(root, root / path)
        if target is None:  # (Q2)
            return _page("Not found", "<p>No such report.</p>", 404)
        if target.is_dir():
            if path and not path.endswith("/"):  # (Q3)
                return RedirectResponse(f"{request.url.path}/", status_code=307)
            index = _inside(root, target / "index.html")  # (Q2) a linked index.html too
            if index is not None and index.is_file():
                return FileResponse(index, headers=HEADERS)
            return _listing(target, root)
        if target.is_file():
            return FileResponse(target, headers=HEADERS)
        return _page("Not found", f"<p>No report at <code>{html.escape(path)}</code>.</p>", 404)

    return app


class QualityReportsPlugin(AirflowPlugin):
    """The "Quality reports" nav entry and the app behind it."""

    name = "clickstream_quality_reports"
    fastapi_apps: ClassVar[list[dict[str, Any]]] = [{"app": create_app(), "url_prefix": URL_PREFIX,
                     "name": "Clickstream quality reports"}]
    external_views: ClassVar[list[dict[str, Any]]] = [{
        "name": VIEW_NAME,
        "href": URL_PREFIX.lstrip("/") + "/",  # relative to the UI's base URL
        "destination": "nav",
        "url_route": "quality-reports",
        "nav_top_level": True,
    }, {
        "name": "Read point",
        "href": f"{URL_PREFIX.lstrip('/')}/{READ_POINT_PATH}",
        "destination": "nav",
        "url_route": "read-point",
        "nav_top_level": True,
    }]
