"""FossilSite: a Fossil repository of a small code project (code, tickets, wiki, forum) served locally.

The demo repository is built once from data/fossil_seed.json into the cache folder (commits by
three developers, a release tag, wiki pages, tickets with labelled edit forms, forum threads);
each site instance serves its own copy with `fossil server --localauth`, so a browser on
127.0.0.1 is logged in as the admin and can file and edit tickets without a password. All state is
the one repository file: reset copies the snapshot back, checks are SQL on it.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Mapping

from longhorizon.envs.web.apps.serving import (
    DATA_DIR, LocalSite, cache_dir, check_sql, fingerprint, free_port, read_tail, replace_file, require_program,
    start_process, stop_process, wait_for_http,
)

INSTALL_HINT = "apt-get install -y --no-install-recommends fossil"
SEED_FILE = DATA_DIR / "fossil_seed.json"
TICKET_TEMPLATES = {"ticket-common": DATA_DIR / "fossil_ticket_common.th1",
                    "ticket-newpage": DATA_DIR / "fossil_ticket_new.th1",
                    "ticket-editpage": DATA_DIR / "fossil_ticket_edit.th1"}
REPORT_SQL = DATA_DIR / "fossil_report.sql"
SEED_PASSWORD = "pagesmith-demo"
BUILD_FORMAT = "2"  # bump to rebuild cached repositories after a change to the build steps


def _fossil(fossil: str, *args: str, cwd: Path, user: str, stdin: str | None = None) -> str:
    environment = dict(os.environ, USER=user, HOME=str(cwd))
    result = subprocess.run([fossil, *args], cwd=cwd, env=environment, input=stdin, capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"fossil {' '.join(args[:2])} failed: {result.stdout}{result.stderr}")
    return result.stdout


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def build_repository(target: Path) -> None:
    """Build the demo repository from the seed file at `target` (a .fossil file)."""
    fossil = require_program("fossil", INSTALL_HINT)
    seed = json.loads(SEED_FILE.read_text())
    admin = seed["admin"]
    with tempfile.TemporaryDirectory(prefix="longhorizon-fossil-build-") as scratch:
        work = Path(scratch)
        repo = work / "repo.fossil"
        first_date = seed["commits"][0]["date"]
        _fossil(fossil, "init", "--admin-user", admin, "--date-override", first_date, str(repo), cwd=work, user=admin)
        settings = {"project-name": seed["project_name"], "project-description": seed["project_description"],
                    # The default footer reports how long the page took to render, which would make
                    # the same page read differently on every visit.
                    "footer": f"<footer>{seed['project_name']}</footer>",
                    **{name: path.read_text() for name, path in TICKET_TEMPLATES.items()}}
        statements = [f"REPLACE INTO config(name, value, mtime) VALUES({_sql_literal(k)}, {_sql_literal(v)}, now());"
                      for k, v in settings.items()]
        # The ticket list is sorted by title so that a row keeps its position from build to build.
        statements.append(f"UPDATE reportfmt SET sqlcode = {_sql_literal(REPORT_SQL.read_text())} WHERE rn = 1;")
        _fossil(fossil, "sql", "-R", str(repo), cwd=work, user=admin, stdin="\n".join(statements))
        for login, full_name in seed["users"]:
            _fossil(fossil, "user", "new", login, f"{full_name} <{login}@example.com>", SEED_PASSWORD, "-R", str(repo),
                    cwd=work, user=admin)
            _fossil(fossil, "user", "capabilities", login, "s", "-R", str(repo), cwd=work, user=admin)
        checkout = work / "checkout"
        checkout.mkdir()
        _fossil(fossil, "open", str(repo), cwd=checkout, user=admin)
        # Files rewritten within one second keep their size and mtime; make Fossil compare hashes.
        _fossil(fossil, "settings", "mtime-changes", "off", cwd=checkout, user=admin)
        for commit in seed["commits"]:
            for relative, content in commit["files"].items():
                path = checkout / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
            _fossil(fossil, "addremove", cwd=checkout, user=commit["user"])
            _fossil(fossil, "commit", "-m", commit["message"], "--user", commit["user"], "--date-override",
                    commit["date"], "--no-warnings", cwd=checkout, user=commit["user"])
            if "tag" in commit:
                _fossil(fossil, "tag", "add", "--date-override", commit["date"], "--user", commit["user"],
                        commit["tag"], "current", cwd=checkout, user=commit["user"])
        _fossil(fossil, "close", "--force", cwd=checkout, user=admin)
        for page in seed["wiki"]:
            _fossil(fossil, "wiki", "create", page["name"], "-", "--mimetype", "text/x-markdown", "-R", str(repo),
                    cwd=work, user=page["user"], stdin=page["text"])
        for ticket in seed["tickets"]:
            fields = {key: value for key, value in ticket.items() if key not in ("user", "description")}
            arguments = [item for key, value in fields.items() for item in (key, value)]
            _fossil(fossil, "ticket", "add", *arguments, "icomment", ticket["description"], "mimetype",
                    "text/x-markdown", "-R", str(repo), cwd=work, user=ticket["user"])
        _post_forum(fossil, repo, seed, work)
        _fossil(fossil, "sql", "-R", str(repo), cwd=work, user=admin, stdin="VACUUM;")
        # Another process may build the same repository at the same time; each writes its own
        # copy and the atomic rename makes the last one win, never a half-written file.
        replace_file(repo, target)


def _post_forum(fossil: str, repo: Path, seed: Mapping[str, Any], work: Path) -> None:
    """Forum posts have no command-line form, so they are posted through a short-lived server."""
    port = free_port()
    log_path = work / "forum-server.log"
    process = start_process([fossil, "server", "--localhost", "--nojail", "--port", str(port), str(repo)], log_path, cwd=work,
                            env=dict(os.environ, HOME=str(work)))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(base + "/", process, log_path)
        for thread in seed["forum"]:
            root_url = _forum_post(base, thread["user"], "/forume1", {"title": thread["title"], "content": thread["text"]})
            root_hash = root_url.rstrip("/").rsplit("/", 1)[-1]
            for user, text in thread["replies"]:
                _forum_post(base, user, "/forume2", {"fpid": root_hash, "reply": "1", "content": text})
    except Exception as error:
        raise RuntimeError(f"posting the seed forum threads failed: {error}; {read_tail(log_path)}") from error
    finally:
        stop_process(process)


def _forum_post(base: str, user: str, path: str, fields: Mapping[str, str]) -> str:
    """Log in as `user`, submit one forum form and return the URL Fossil redirects to."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    login = urllib.parse.urlencode({"u": user, "p": SEED_PASSWORD, "in": "Login"}).encode()
    opener.open(urllib.request.Request(base + "/login", data=login))
    form = urllib.parse.urlencode({**fields, "mimetype": "text/x-markdown", "submit": "Submit"}).encode()
    request = urllib.request.Request(base + path, data=form, headers={"Referer": base + path})
    with opener.open(request) as response:
        final_url = response.geturl()
    if "/forumpost/" not in final_url:
        raise RuntimeError(f"the forum did not accept the post to {path} (ended at {final_url})")
    return final_url


def cached_repository() -> Path:
    """The demo repository in the cache folder, built on first use and whenever the seed changes."""
    sources = [SEED_FILE, REPORT_SQL, *TICKET_TEMPLATES.values()]
    inputs = [BUILD_FORMAT, *(path.read_bytes() for path in sources)]
    target = cache_dir("web", "fossil") / f"pagesmith-{fingerprint(*inputs)}.fossil"
    if not target.exists():
        build_repository(target)
    return target


class FossilSite(LocalSite):
    """The demo Fossil repository as a site."""

    name = "fossil"
    ready_path = "/home"

    @property
    def repository(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "pagesmith.fossil"

    @property
    def snapshot(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "snapshot.fossil"

    def prepare(self, workdir: Path) -> None:
        shutil.copyfile(cached_repository(), self.snapshot)
        replace_file(self.snapshot, self.repository)

    def server_command(self, port: int) -> tuple[list[str], Path | None, dict[str, str] | None]:
        assert self.workdir is not None
        fossil = require_program("fossil", INSTALL_HINT)
        # --nojail: run as root, Fossil would chroot into the repository's folder, where /dev/null
        # and /dev/urandom do not exist (it then prints warnings on every admin page).
        return ([fossil, "server", "--localhost", "--localauth", "--nojail", "--port", str(port), str(self.repository)],
                self.workdir, dict(os.environ, HOME=str(self.workdir)))

    def restore(self) -> None:
        replace_file(self.snapshot, self.repository)

    def check_state(self, check: Mapping[str, Any]) -> tuple[bool, str]:
        if check.get("type") != "sql":
            raise ValueError(f"the fossil site understands state checks of type 'sql', got {check!r}")
        if self.workdir is None:
            raise RuntimeError("site 'fossil' is not started")
        return check_sql(self.repository, dict(check))
