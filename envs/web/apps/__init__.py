"""Web applications run on this machine for the WebArena-like tier: Fossil, DokuWiki and a shop."""
