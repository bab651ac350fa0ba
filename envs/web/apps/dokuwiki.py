"""DokuWikiSite: the Debian DokuWiki serving a per-instance team wiki through PHP's built-in web server.

Each instance gets its own configuration folder (a copy of /etc/dokuwiki with a local.php that
points the data folder at the instance) and its own data folder seeded from data/dokuwiki_pages.
A small PHP file, loaded before every script through auto_prepend_file, tells DokuWiki where that
configuration is, so the system installation stays untouched. Anyone may edit (no ACL). Reset
restores the seeded data folder; checks read the page files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping

from longhorizon.envs.web.apps.serving import DATA_DIR, LocalSite, require_program

INSTALL_HINT = "apt-get install -y --no-install-recommends dokuwiki php-cli"
DOKUWIKI_ROOT = Path("/usr/share/dokuwiki")
SYSTEM_CONF = Path("/etc/dokuwiki")
SEED_PAGES = DATA_DIR / "dokuwiki_pages"
WIKI_TITLE = "Northwind Labs Wiki"
DATA_SUBFOLDERS = ("pages", "meta", "attic", "media", "media_attic", "media_meta", "cache", "index", "locks", "tmp",
                   "log")


def page_file(data_dir: Path, page_id: str) -> Path:
    """The text file of a page id such as "projects:apollo" (DokuWiki's own name cleaning, simplified)."""
    parts = [part.strip().lower().replace(" ", "_") for part in page_id.strip(":").split(":")]
    if not parts or any(not part or part in (".", "..") or "/" in part for part in parts):
        raise ValueError(f"not a valid page id: {page_id!r}")
    return data_dir.joinpath("pages", *parts[:-1], parts[-1] + ".txt")


class DokuWikiSite(LocalSite):
    """The team wiki as a site."""

    name = "dokuwiki"
    ready_path = "/doku.php?id=start"

    @property
    def data_dir(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "data"

    @property
    def snapshot_dir(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "snapshot"

    def prepare(self, workdir: Path) -> None:
        php = require_program("php", INSTALL_HINT)
        if not (DOKUWIKI_ROOT / "doku.php").exists() or not (SYSTEM_CONF / "dokuwiki.php").exists():
            raise RuntimeError(f"DokuWiki is not installed under {DOKUWIKI_ROOT}; install it with: {INSTALL_HINT}")
        conf = workdir / "conf"
        conf.mkdir()
        for source in SYSTEM_CONF.iterdir():
            # Skip the Debian install's ACL and user files (symlinks into /var/lib): this wiki runs without ACL.
            if source.is_file() and os.access(source, os.R_OK) and source.name not in ("local.php", "acl.auth.php",
                                                                                   "users.auth.php"):
                shutil.copyfile(source, conf / source.name)
        (conf / "local.php").write_text(
            "<?php\n"
            f"$conf['title'] = '{WIKI_TITLE}';\n"
            f"$conf['savedir'] = '{self.data_dir}';\n"
            "$conf['useacl'] = 0;\n"
            "$conf['dnslookups'] = 0;\n"
            "$conf['updatecheck'] = 0;\n"
            "$conf['userewrite'] = 0;\n"
            "$conf['breadcrumbs'] = 0;\n"
            "$conf['youarehere'] = 1;\n"
            "$conf['license'] = '';\n"
        )
        # DokuWiki's editor textarea has no label; name it for the accessibility tree (DokuWiki serves
        # conf/userscript.js with its own scripts).
        (conf / "userscript.js").write_text(
            "jQuery(function () { jQuery('#wiki__text').attr('aria-label', 'Page text'); "
            "jQuery('#qsearch__in').attr('aria-label', 'Search the wiki'); });\n"
        )
        (workdir / "prepend.php").write_text(
            "<?php\n"
            f"if (!defined('DOKU_CONF')) define('DOKU_CONF', '{conf}/');\n"
            f"if (!defined('DOKU_MAIN_CONF')) define('DOKU_MAIN_CONF', '{conf}/');\n"
        )
        for folder in DATA_SUBFOLDERS:
            (self.data_dir / folder).mkdir(parents=True)
        shutil.copytree(SEED_PAGES, self.data_dir / "pages", dirs_exist_ok=True)
        # Build the full-text index now so the wiki's search works from the first request.
        result = subprocess.run([php, "-d", f"auto_prepend_file={workdir / 'prepend.php'}",
                                 str(DOKUWIKI_ROOT / "bin" / "indexer.php"), "-q"], cwd=workdir,
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"DokuWiki's indexer failed: {result.stdout}{result.stderr}")
        shutil.copytree(self.data_dir, self.snapshot_dir, symlinks=True)

    def server_command(self, port: int) -> tuple[list[str], Path | None, dict[str, str] | None]:
        assert self.workdir is not None
        php = require_program("php", INSTALL_HINT)
        # Two workers so a page and its stylesheet requests do not queue behind each other.
        environment = dict(os.environ, PHP_CLI_SERVER_WORKERS="2")
        return ([php, "-d", f"auto_prepend_file={self.workdir / 'prepend.php'}", "-S", f"127.0.0.1:{port}",
                 "-t", str(DOKUWIKI_ROOT)], self.workdir, environment)

    def restore(self) -> None:
        shutil.rmtree(self.data_dir)
        shutil.copytree(self.snapshot_dir, self.data_dir, symlinks=True)

    def page_text(self, page_id: str) -> str | None:
        """A page's wiki text, or None if the page does not exist."""
        path = page_file(self.data_dir, page_id)
        return path.read_text(encoding="utf-8") if path.exists() else None

    def check_state(self, check: Mapping[str, Any]) -> tuple[bool, str]:
        """Score {"type": "page", "page": id, "exists": bool, "must_include": [...], "must_exclude": [...]}.

        Text tests are case-insensitive substring tests on the page's wiki text.
        """
        if check.get("type") != "page" or not isinstance(check.get("page"), str):
            raise ValueError(f"the dokuwiki site understands checks of type 'page' with a 'page' id, got {check!r}")
        if self.workdir is None:
            raise RuntimeError("site 'dokuwiki' is not started")
        text = self.page_text(check["page"])
        page = check["page"]
        should_exist = check.get("exists", True)
        if text is None or not text.strip():  # DokuWiki deletes a page by saving it empty
            return (not should_exist), f"page {page!r} does not exist"
        if not should_exist:
            return False, f"page {page!r} exists"
        lowered = text.lower()
        for needle in check.get("must_include", ()):
            if needle.lower() not in lowered:
                return False, f"page {page!r} lacks {needle!r}"
        for needle in check.get("must_exclude", ()):
            if needle.lower() in lowered:
                return False, f"page {page!r} still contains {needle!r}"
        return True, f"page {page!r} matches"
