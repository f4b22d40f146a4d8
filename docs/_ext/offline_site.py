"""The built site loads nothing from the internet: a page that would (a script, a
stylesheet, an image or a frame from another host) fails the build, naming the page and
the address.

Readers on HPC login nodes and laptops on trains open docs/_build/html as files; nbdist's
own pages hold to the same rule (nothing a browser loads comes from elsewhere). Links that
a reader may follow (`<a href=...>`) are not loads and stay allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# src= or href= of what a browser fetches by itself while showing a page.
_LOADS = re.compile(
    r"<(?P<tag>script|img|iframe|source|link)\b[^>]*?\b(?:src|href)\s*=\s*[\"'](?P<url>(?:https?:)?//[^\"']+)",
    re.IGNORECASE,
)


def remote_loads(html: str) -> list[str]:
    """The addresses on other hosts that a page would load (a `<link>` only as a stylesheet,
    icon or preload; others, such as rel=canonical, are not fetched)."""
    found = []
    for match in _LOADS.finditer(html):
        tag = match.group(0)
        if match.group("tag").lower() == "link" and not re.search(r"rel=[\"'][^\"']*(stylesheet|icon|preload)", tag):
            continue
        found.append(match.group("url"))
    return found


def check_site(outdir: Path) -> list[str]:
    problems = []
    for page in sorted(outdir.rglob("*.html")):
        for url in remote_loads(page.read_text(errors="replace")):
            problems.append(f"{page.relative_to(outdir)} loads {url}")
    return problems


def _on_build_finished(app: Any, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    from sphinx.errors import ExtensionError

    problems = check_site(Path(app.outdir))
    if problems:
        shown = "\n  ".join(problems[:20])
        raise ExtensionError(f"the site would load {len(problems)} thing(s) from the internet:\n  {shown}")


def setup(app: Any) -> dict[str, Any]:
    # After sphinx-mathjax-offline has copied MathJax into _static (also build-finished).
    app.connect("build-finished", _on_build_finished, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
