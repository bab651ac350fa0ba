"""The contract between the browser environment and the web applications it visits.

A site is one web application reachable from the browser: a local app this package starts
(Fossil, DokuWiki, the shop) or a site the user runs elsewhere (WebArena's own containers). The
browser env asks a site for its URL and allowed origins, resets it before a state-changing task and
lets it score state checks that only the application can answer (a row in its database, a page in
its files). Methods are blocking; the env calls them from a worker thread.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable


@runtime_checkable
class Site(Protocol):
    name: str
    """The key tasks use in their "sites" list, e.g. "shop"; "__SHOP__" in a task URL is replaced by
    the site's base URL (the key upper-cased between double underscores)."""

    @property
    def base_url(self) -> str:
        """E.g. "http://127.0.0.1:41233"; valid once started."""
        ...

    @property
    def allowed_origins(self) -> tuple[str, ...]:
        """Origins ("http://127.0.0.1:41233") the browser may load from while on this site."""
        ...

    def start(self) -> None:
        """Start serving (idempotent); raises RuntimeError with the reason if the app cannot run."""
        ...

    def reset(self) -> None:
        """Restore the state the site had when started (its snapshot)."""
        ...

    def check_state(self, check: Mapping[str, Any]) -> tuple[bool, str]:
        """Score one site-specific state check from a task's eval "state_check" list; returns
        (passed, a short reason for people). Raises ValueError for a check it does not understand."""
        ...

    def stop(self) -> None:
        """Stop serving and remove what start() created (idempotent)."""
        ...
