"""ShopSite: the demo shop served from a private copy of its seeded database."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

from longhorizon.envs.web.apps.serving import LocalSite, check_sql, replace_file
from longhorizon.envs.web.apps.shop_catalog import write_seed_database


class ShopSite(LocalSite):
    """The shop (shop_server.py) as a site; state is one SQLite file, restored by copying the snapshot."""

    name = "shop"

    @property
    def database(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "shop.sqlite"

    @property
    def snapshot(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "snapshot.sqlite"

    def prepare(self, workdir: Path) -> None:
        write_seed_database(self.snapshot)
        replace_file(self.snapshot, self.database)

    def server_command(self, port: int) -> tuple[list[str], Path | None, dict[str, str] | None]:
        return [sys.executable, "-m", "longhorizon.envs.web.apps.shop_server", "--db", str(self.database),
                "--port", str(port)], None, None

    def restore(self) -> None:
        replace_file(self.snapshot, self.database)

    def check_state(self, check: Mapping[str, Any]) -> tuple[bool, str]:
        if check.get("type") != "sql":
            raise ValueError(f"the shop understands state checks of type 'sql', got {check!r}")
        if self.workdir is None:
            raise RuntimeError("site 'shop' is not started")
        return check_sql(self.database, dict(check))
