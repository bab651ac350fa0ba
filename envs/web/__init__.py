"""Web navigation: a real Chromium driven through Playwright, MiniWoB++ tasks, local web apps and WebArena task configs."""
