"""Files shared by every page of the dashboard folder: Plotly's JavaScript, written once."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = "assets"
PLOTLY_JS = f"{ASSETS_DIR}/plotly.min.js"


def write_assets(out: Path) -> None:
    """Write `assets/plotly.min.js` under `out` (skipped when an identical copy is already there)."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs().encode("utf-8")
    path = out / PLOTLY_JS
    if path.is_file() and path.stat().st_size == len(js) and path.read_bytes() == js:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(js)
