"""Makes docs/playground.png: the playground in headless Chromium against `specsplit serve`
on the embedded SmolLM2 with its in-gateway n-gram draft.

    .venv/bin/python -m docs.playground_screenshot [--compare]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from urllib.parse import urlencode

from playwright.sync_api import sync_playwright

from tests.gateway.test_serve import Serve

PROMPT = (
    "Repeat exactly: The old lighthouse stood at the edge of the cliff, and every night "
    "its keeper climbed the stairs to light the lamp for the ships passing by."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--compare", action="store_true", help="also run with speculation off")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "playground.png")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    server = Serve(Path(tempfile.mkdtemp()))
    try:
        server.wait_ready()
        query = {"prompt": PROMPT, "max_tokens": 64, "autorun": 1, "compare": int(args.compare)}
        url = server.state["url"].removesuffix("/v1") + "/playground?" + urlencode(query)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium)
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(url)
            page.wait_for_selector("body[data-state=done]", timeout=300_000)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        server.stop()
    print(args.out)


if __name__ == "__main__":
    main()
