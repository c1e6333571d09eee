"""Set the Airflow UI password of user "admin" in SimpleAuthManager's passwords file.

    python scripts/airflow_password.py --file PATH                 # embedded: generate once
    python scripts/airflow_password.py --file PATH --from-env VAR  # cluster: from a secret

Without ``--from-env``, a random password is generated only if the file has none for
"admin"; it is printed once (stdout) and never again. With ``--from-env``, the password is
taken from that environment variable (which must be set and non-empty). The file is written
with mode 600. There is never a fixed default password.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

USER = "admin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True, type=Path, help="the passwords JSON file")
    parser.add_argument("--from-env", default=None, metavar="VAR",
                        help="take the password from this environment variable")
    args = parser.parse_args(argv)
    passwords: dict[str, str] = {}
    if args.file.exists() and args.file.read_text().strip():
        passwords = json.loads(args.file.read_text())
    if args.from_env:
        password = os.environ.get(args.from_env, "")
        if not password:
            print(f"airflow_password: {args.from_env} is not set; refusing to start without "
                  "an admin password", file=sys.stderr)
            return 1
        generated = False
    elif passwords.get(USER):
        return 0
    else:
        password, generated = secrets.token_urlsafe(15), True
    passwords[USER] = password
    args.file.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(args.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(handle, "w") as out:
        out.write(json.dumps(passwords) + "\n")
    os.chmod(args.file, 0o600)
    if generated:
        print(password)
    return 0


if __name__ == "__main__":
    sys.exit(main())
