"""The "Quality reports" plugin: mounted in Airflow's API server, listed as a nav entry, serving
$CLICKSTREAM_HOME/reports to logged-in users only."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from tests.dags.airflow_env import admin_token, api_server_app

PREFIX = "/clickstream-reports"


@pytest.fixture(scope="module")
def airflow_app(airflow_db):
    with api_server_app() as app:
        yield app


@pytest.fixture
def client(airflow_app, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("CLICKSTREAM_HOME", str(tmp_path / "home"))
    with TestClient(airflow_app, follow_redirects=False) as test_client:
        yield test_client


@pytest.fixture
def token(airflow_app) -> str:
    return admin_token()


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    root = tmp_path / "home" / "reports"
    (root / "backfills").mkdir(parents=True)
    (root / "index.html").write_text("<h1>All quality reports</h1>")
    (root / "backfills" / "run-1.html").write_text("<p>backfill run-1</p>")
    (tmp_path / "home" / "secret.txt").write_text("not a report")
    return root


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_refused_without_login(client, reports: Path) -> None:
    response = client.get(f"{PREFIX}/")
    assert response.status_code == 401
    assert "All quality reports" not in response.text
    assert client.get(f"{PREFIX}/backfills/run-1.html").status_code == 401


def test_a_browser_without_login_is_sent_to_the_login_page(client, reports: Path) -> None:
    response = client.get(f"{PREFIX}/backfills/run-1.html", headers={"Accept": "text/html"})
    assert response.status_code == 303
    assert response.headers["location"].startswith("/auth/login")
    assert "next=" in response.headers["location"]
    forged = client.get(f"{PREFIX}/backfills/run-1.html?x=1",
                        headers={"Accept": "text/html", "Host": "evil.example"})
    back = parse_qs(urlsplit(forged.headers["location"]).query)["next"]
    assert back == [f"{PREFIX}/backfills/run-1.html?x=1"]  # by path, not the Host it was sent


def test_an_invalid_token_is_refused(client, reports: Path) -> None:
    assert client.get(f"{PREFIX}/", headers=bearer("not-a-jwt")).status_code == 403


def test_refused_to_a_user_the_auth_manager_does_not_let_see_the_view(
        client, reports: Path) -> None:
    """A login alone let any user read every client's reports; SimpleAuthManager lets a
    viewer see a plugin's view and a user without a role see nothing."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    def token_of(role: str | None) -> str:
        return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="u", role=role))

    refused = client.get(f"{PREFIX}/backfills/run-1.html", headers=bearer(token_of(None)))
    assert refused.status_code == 403 and "backfill run-1" not in refused.text
    assert "may not see 'Quality reports'" in refused.text
    viewer = client.get(f"{PREFIX}/backfills/run-1.html", headers=bearer(token_of("viewer")))
    assert viewer.status_code == 200 and "backfill run-1" in viewer.text


def test_a_logged_in_browser_user_without_the_view_gets_403_not_the_login_page(
        client, reports: Path) -> None:
    """A browser (Accept: text/html, the UI's cookie) of a logged-in user without the view was
    sent to the login page (303), where logging in again led back to the same refusal."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    client.cookies.set("_token", get_auth_manager().generate_jwt(
        SimpleAuthManagerUser(username="u", role=None)))
    response = client.get(f"{PREFIX}/backfills/run-1.html", headers={"Accept": "text/html"})
    assert response.status_code == 403, response.headers.get("location")
    assert "may not see 'Quality reports'" in response.text
    assert "backfill run-1" not in response.text
    client.cookies.set("_token", "not-a-jwt")  # not logged in after all: the login page
    assert client.get(f"{PREFIX}/", headers={"Accept": "text/html"}).status_code == 303


def test_no_script_runs_on_a_served_gx_page(client, token: str, tmp_path: Path) -> None:
    """GX Data Docs pages load ~9 scripts from public CDNs (vega@5, vega-lite@5 and
    vega-embed@6 unpinned); served with only ``frame-ancestors 'self'``, they ran on Airflow's
    origin as the logged-in user."""
    from clickstream.config import Config
    from clickstream.quality.reports import write_suite_page

    write_suite_page(Config.from_env(), "historical_batch")
    response = client.get(f"{PREFIX}/expectations/historical_batch.html", headers=bearer(token))
    assert response.status_code == 200 and "https://cdn.jsdelivr.net/npm/vega@5" in response.text
    policy = [d.strip() for d in response.headers["content-security-policy"].split(";")]
    assert "script-src 'none'" in policy and "object-src 'none'" in policy
    assert "frame-ancestors 'self'" in policy
    assert not any(d.startswith(("style-src", "default-src")) for d in policy)  # styles stay


def test_served_to_a_logged_in_user(client, token: str, reports: Path) -> None:
    index = client.get(f"{PREFIX}/", headers=bearer(token))
    assert index.status_code == 200 and "All quality reports" in index.text
    page = client.get(f"{PREFIX}/backfills/run-1.html", headers=bearer(token))
    assert page.status_code == 200 and "backfill run-1" in page.text
    listing = client.get(f"{PREFIX}/backfills/", headers=bearer(token))
    assert listing.status_code == 200 and "run-1.html" in listing.text
    assert client.get(f"{PREFIX}/backfills", headers=bearer(token)).status_code == 307


def test_a_malformed_setting_the_pages_do_not_use_does_not_break_them(
        client, token: str, reports: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every page was a 500 (the whole configuration was read to find the home folder)."""
    monkeypatch.setenv("CLICKSTREAM_SESSION_GAP", "thirty")
    index = client.get(f"{PREFIX}/", headers=bearer(token))
    assert index.status_code == 200 and "All quality reports" in index.text


def test_a_home_setting_the_product_refuses_is_named_on_the_page(
        client, token: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An opaque 500 on every page (the setting's ConfigError escaped the app)."""
    monkeypatch.setenv("CLICKSTREAM_HOME", str(tmp_path / "home[1]"))
    page = client.get(f"{PREFIX}/", headers=bearer(token))
    assert page.status_code == 500
    assert "The reports folder's setting is refused: " in page.text
    assert "CLICKSTREAM_HOME or --home" in page.text


def test_a_listing_links_every_name_as_a_relative_path(client, token: str,
                                                       reports: Path) -> None:
    """A name is a path, never a scheme, an anchor or a query of the listing's link."""
    (reports / "backfills" / "javascript:alert(1)").write_text("x")
    (reports / "backfills" / "run #2?.html").write_text("<p>backfill run #2</p>")
    listing = client.get(f"{PREFIX}/backfills/", headers=bearer(token))
    assert "href='./javascript%3Aalert%281%29'" in listing.text
    assert "href='./run%20%232%3F.html'" in listing.text
    page = client.get(f"{PREFIX}/backfills/run%20%232%3F.html", headers=bearer(token))
    assert page.status_code == 200 and "backfill run #2" in page.text


def test_the_ui_session_cookie_is_a_login_too(client, token: str, reports: Path) -> None:
    client.cookies.set("_token", token)
    response = client.get(f"{PREFIX}/", headers={"Accept": "text/html"})
    assert response.status_code == 200 and "All quality reports" in response.text


def test_nothing_outside_the_reports_folder_is_served(client, token: str,
                                                      reports: Path) -> None:
    # (HTTP clients normalise a literal "../" away before sending; encoded dots and an
    # encoded absolute path reach the plugin.)
    absolute = quote(str(reports.parent / "secret.txt"), safe="")
    for path in ("%2e%2e/secret.txt", "backfills/%2e%2e/%2e%2e/secret.txt", absolute):
        response = client.get(f"{PREFIX}/{path}", headers=bearer(token))
        assert "not a report" not in response.text, path
    assert client.get(f"{PREFIX}/%2e%2e/secret.txt", headers=bearer(token)).status_code == 404


def test_a_linked_index_or_an_unnameable_path_is_not_served(client, token: str,
                                                           reports: Path) -> None:
    (reports / "linked").mkdir()
    (reports / "linked" / "index.html").symlink_to(reports.parent / "secret.txt")
    response = client.get(f"{PREFIX}/linked/", headers=bearer(token))
    assert "not a report" not in response.text
    assert response.status_code == 200  # the folder is listed instead, its link leads nowhere
    assert client.get(f"{PREFIX}/linked/index.html", headers=bearer(token)).status_code == 404
    assert client.get(f"{PREFIX}/run%00.html", headers=bearer(token)).status_code == 404
    too_long = "a" * 300  # resolve() takes it; the file system refuses the name
    for path in (too_long, f"linked/{too_long}", f"{too_long}/"):
        assert client.get(f"{PREFIX}/{path}", headers=bearer(token)).status_code == 404
    (reports / "loop").symlink_to("loop")  # Python 3.11 raises RuntimeError: it was a 500
    for path in ("loop", "loop/index.html"):
        assert client.get(f"{PREFIX}/{path}", headers=bearer(token)).status_code == 404


def test_a_friendly_page_when_there_are_no_reports_yet(client, token: str) -> None:
    response = client.get(f"{PREFIX}/", headers=bearer(token))
    assert response.status_code == 200
    assert "No reports yet" in response.text


def test_quality_reports_is_an_entry_of_the_ui_navigation(client, token: str) -> None:
    response = client.get("/api/v2/plugins", headers=bearer(token))
    assert response.status_code == 200
    views = [view for plugin in response.json()["plugins"]
             for view in plugin["external_views"]]
    entry = next(view for view in views if view["name"] == "Quality reports")
    assert entry["destination"] == "nav"
    assert entry["href"] == PREFIX.lstrip("/") + "/"  # relative to the UI's base URL
    assert entry["url_route"] == "quality-reports"
    apps = [a for plugin in response.json()["plugins"] for a in plugin["fastapi_apps"]]
    assert any(a["url_prefix"] == PREFIX for a in apps)
    read_point_entry = next(view for view in views if view["name"] == "Read point")
    assert read_point_entry["href"] == f"{PREFIX.lstrip('/')}/read-point"
    assert read_point_entry["destination"] == "nav"


def test_the_read_point_page_shows_the_versions_and_what_holds_a_client(
        client, token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator asking why a dashboard does not show a client's backfill yet finds the
    group holding it, and what to do, in the UI."""
    from clickstream.config import Config
    from clickstream.io import read_point
    from clickstream.io.delta_tables import open_tables

    warehouse = tmp_path / "warehouse"
    monkeypatch.setenv("CLICKSTREAM_WAREHOUSE", str(warehouse))
    page = client.get(f"{PREFIX}/read-point", headers=bearer(token))
    assert page.status_code == 200 and "No read point yet" in page.text

    config = Config().replace(warehouse=warehouse, delta_engine="deltalake")
    read_point.open_group(config, open_tables(config), "backfill-x<1>", "client-00")
    page = client.get(f"{PREFIX}/read-point", headers=bearer(token))
    assert page.status_code == 200
    assert "<tr><td>pageviews</td><td>-1</td></tr>" in page.text
    assert "backfill-x&lt;1&gt; (open since " in page.text
    assert "holds client client-00)" in page.text
    assert "clickstream read-point --release GROUP" in page.text
    assert client.get(f"{PREFIX}/read-point").status_code == 401  # a login, as every page
