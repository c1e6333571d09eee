"""Trigger a DAG through Airflow's REST API and follow the run (used by scripts/demo.sh).

    python scripts/airflow_demo.py trigger late_batch_backfill --conf '{"client": ...}'

Logs in as "admin" with the password from SimpleAuthManager's passwords file (a JWT from
POST /auth/token), waits until the DAG is parsed, unpauses it, triggers a run with the conf
(the same values the UI's trigger form sends), polls until the run ends, then prints each
task's state and what each step of the backfill did (from the results its steps saved) with
the failed step's reason and the path of the run's page in the quality reports. Exit status 0
only if the run succeeded, 4 if it has not ended after --timeout (it goes on: follow it in the
UI), 1 if it failed or could not be triggered, 2 for bad arguments (such as --conf that is not
a JSON object).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

FINISHED = {"success", "failed"}
BACKFILL_DAG = "late_batch_backfill"
STILL_RUNNING = 4
"""The exit status when the run has not ended after ``--timeout``: not a failure."""


def refused(response: httpx.Response, what: str) -> SystemExit:
    """The API's own reason for a 4xx (an invalid Param names the Param and the rule), which
    ``raise_for_status`` would replace with the status line alone."""
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    return SystemExit(f"{what}: the API refused it ({response.status_code}): "
                      f"{detail if isinstance(detail, str) else json.dumps(detail)}")


def client(base_url: str, password_file: str) -> httpx.Client:
    with open(password_file) as handle:
        password = json.load(handle)["admin"]
    response = httpx.post(f"{base_url}/auth/token",
                          json={"username": "admin", "password": password}, timeout=30)
    if 400 <= response.status_code < 500:
        raise refused(response, f"log in to {base_url} as admin")
    response.raise_for_status()
    token = response.json()["access_token"]
    return httpx.Client(base_url=f"{base_url}/api/v2", timeout=30,
                        headers={"Authorization": f"Bearer {token}"})


def with_retries(send: Callable[[], httpx.Response], what: str,
                 attempts: int = 5) -> httpx.Response:
    """``send()`` again after a 5xx: with the demo's SQLite metadata DB, a write waits at most
    5 s for the lock while tasks start, and the API answers 500 ("database is locked")."""
    for attempt in range(1, attempts + 1):
        response = send()
        if 400 <= response.status_code < 500:
            raise refused(response, what)
        if response.status_code < 500 or attempt == attempts:
            response.raise_for_status()
            return response
        print(f"  {what}: the API answered {response.status_code} (a busy SQLite metadata DB?); "
              f"retrying ({attempt} of {attempts - 1})", flush=True)
        time.sleep(2 * attempt)
    raise AssertionError("unreachable")


def wait_for_dag(api: httpx.Client, dag_id: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if api.get(f"/dags/{dag_id}").status_code == 200:
            with_retries(lambda: api.patch(f"/dags/{dag_id}", json={"is_paused": False}),
                         f"unpause {dag_id}")
            return
        time.sleep(2)
    known = sorted(dag["dag_id"] for dag in api.get("/dags").json().get("dags", []))
    raise SystemExit(f"no DAG {dag_id!r} after {timeout_s:.0f} s: Airflow knows "
                     f"{', '.join(known) or 'no DAG yet'}. A misspelled id, or a DAG file that "
                     "did not parse: see Browse -> DAG import errors, or the dag-processor log")


def trigger(api: httpx.Client, dag_id: str, conf: dict, timeout_s: float) -> int:
    wait_for_dag(api, dag_id)
    since = datetime.now(UTC).isoformat()  # as the reports index stamps its entries
    response = with_retries(lambda: api.post(f"/dags/{dag_id}/dagRuns", json={
        "logical_date": None, "conf": conf}), f"trigger {dag_id}")
    run_id = response.json()["dag_run_id"]
    print(f"triggered {dag_id} run {run_id} with {json.dumps(conf)}", flush=True)
    deadline, state, seen = time.monotonic() + timeout_s, "queued", {}
    while time.monotonic() < deadline:
        # Reads get the same retries: a 500 is no run state, and the demo must not take it
        # for a failed run and trigger the next one while this one runs.
        state = with_retries(lambda: api.get(f"/dags/{dag_id}/dagRuns/{run_id}"),
                             "read the run's state").json()["state"]
        tasks = with_retries(lambda: api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances"),
                             "read the run's tasks").json()
        for ti in tasks.get("task_instances", []):
            if ti["state"] and seen.get(ti["task_id"]) != ti["state"]:
                seen[ti["task_id"]] = ti["state"]
                print(f"  {ti['task_id']}: {ti['state']}", flush=True)
        if state in FINISHED:
            break
        time.sleep(3)
    else:  # not ended: no summary yet, and no failure either
        print(f"run {run_id}: still {state} after {timeout_s:.0f} s (--timeout); it goes on: "
              "follow it in the UI", flush=True)
        return STILL_RUNNING
    print(f"run {run_id}: {state}")
    if dag_id == BACKFILL_DAG:
        print_run_summary(conf, since, state)
    return 0 if state == "success" else 1


def print_run_summary(conf: Mapping[str, Any], since: str, state: str) -> None:
    """What each step of the backfill did, in full, from the results its steps saved, the
    failed step's reason, and where its page in the quality reports is; read under this
    machine's ``$CLICKSTREAM_HOME``, which is Airflow's only when Airflow runs here with it.
    Only a run that wrote its page has its steps' results printed: before its check, the
    saved results are an earlier run's of the same batch (``backfill_steps`` S2, S6)."""
    from clickstream.config import Config
    from clickstream.errors import ClickstreamError
    from clickstream.jobs.backfill_steps import locate_batch, saved_summary_lines
    from clickstream.quality import reports

    config = Config.from_env()
    root = reports.reports_dir(config)
    title = reports.DRY_RUN if conf.get("dry_run") else reports.RUN_SUMMARY
    pages = [e for e in reports.read_entries(root)
             if e.job == "backfill" and e.title == title and e.time >= since
             and e.client_id == conf.get("client")]
    if not pages:
        why = ("the run may have stopped before a step could write one; " if state != "success"
               else "")
        print(f"  no run summary of this run in {root} ({why}summaries are read from this "
              "machine's $CLICKSTREAM_HOME: for an Airflow elsewhere, see its Quality reports "
              "page)")
        return
    page = root / max(pages, key=lambda e: e.time).href
    try:  # the DAG's run id (backfill_steps S2); the kind's default is the form's
        run_id = locate_batch(config, kind=conf.get("kind", "orders"),
                              client_id=conf.get("client", ""),
                              path=conf.get("path", ""))["run_id"]
    except ClickstreamError:  # its files changed or went since the run
        lines = []
    else:
        lines = saved_summary_lines(config, run_id, dry_run=bool(conf.get("dry_run")))
    print(f"  summary ({page}):")
    for step, text in lines:
        print(f"  {step}: {text}")
    failed = re.search(r"<tr><th>([^<]*: failed)</th><td>([^<]*)</td>", page.read_text())
    if failed:  # the failing step's reason: on the page only (failure_line)
        print(f"  {html.unescape(failed[1])}: {html.unescape(failed[2])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["trigger"])
    parser.add_argument("dag_id")
    parser.add_argument("--conf", default="{}", help="the run's parameters as JSON")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait")
    parser.add_argument("--url", default=os.environ.get("AIRFLOW__API__BASE_URL",
                                                        "http://127.0.0.1:8080"))
    parser.add_argument("--password-file", default=os.environ.get(
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"))
    args = parser.parse_args(argv)
    if not args.password_file:
        parser.error("--password-file (or AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE)")
    try:  # before logging in: a typo is the caller's, not the API's
        conf = json.loads(args.conf)
    except ValueError as exc:
        parser.error(f"--conf is not valid JSON ({exc}): {args.conf}")
    if not isinstance(conf, dict):
        parser.error(f"--conf must be a JSON object ({{\"key\": value, ...}}): {args.conf}")
    try:
        with client(args.url, args.password_file) as api:
            return trigger(api, args.dag_id, conf, args.timeout)
    except OSError as exc:  # the passwords file: one line, not a traceback
        raise SystemExit(f"airflow_demo: {exc} (--password-file)") from None
    except httpx.ConnectError as exc:
        raise SystemExit(f"airflow_demo: the Airflow API at {args.url} does not answer "
                         f"({exc}): start it (`bash scripts/airflow.sh`), or pass --url") from None
    except httpx.TransportError as exc:  # a timeout while following a run: it may go on
        raise SystemExit(f"airflow_demo: lost contact with the Airflow API at {args.url} "
                         f"({type(exc).__name__}: {exc}); a triggered run may still be going: "
                         "see the UI") from None


if __name__ == "__main__":
    sys.exit(main())
