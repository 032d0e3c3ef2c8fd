"""The playground page in headless Chromium against a live `specsplit serve`.

Debian's chromium (installed with apt-get when missing; the test skips when it
cannot be) is driven by playwright through its own path. The server runs tiny
models with a draft worker and an API key, so the page must send the key typed
into it; the test reads the tokens, their provenance and the totals from the
DOM, checks the text against the API's and against the same prompt run with
speculation off beside it (`"speculation": {"method": "off"}`), and saves
screenshots.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.debian import debian_tool
from tests.gateway.test_serve import Serve

KEY = "playground-key"
PROMPT = "one two three four one two three"
TOKENS = """els => els.map(e => ({text: e.textContent, i: Number(e.dataset.i),
    source: e.dataset.source, round: Number(e.dataset.round), kind: e.dataset.kind,
    drafter: e.dataset.drafter || null}))"""


@pytest.fixture(scope="module")
def chromium() -> str:
    return debian_tool("chromium")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dir, tiny_draft_dir):
    args = ["--target-model", str(tiny_dir), "--served-model-name", "tiny"]
    args += ["--draft-model", str(tiny_draft_dir), "--api-keys", KEY]
    # the page's runs must show draft tokens: fixed trees draft every round, where adaptive
    # ones may find on a loaded machine that no draft beats rounds of decode steps (their
    # policy has its own tests, tests/gateway/test_adaptive.py and test_decode_steps.py)
    args += ["--no-adaptive-tree"]
    server = Serve(tmp_path_factory.mktemp("playground"), *args)
    try:
        server.wait_ready(120)
        yield server
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def page(chromium, server):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


def base_url(server: Serve) -> str:
    return server.state["url"].removesuffix("/v1")


def api_text(server: Serve, chat: bool) -> str:
    client = OpenAI(base_url=server.state["url"], api_key=KEY, max_retries=0)
    if chat:
        messages = [{"role": "user", "content": PROMPT}]
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=64, temperature=0
        )
        return reply.choices[0].message.content
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=64, temperature=0)
    return reply.choices[0].text


def finished(page, panel: str) -> str:
    page.wait_for_selector(f"#{panel}:is([data-state=done], [data-state=error])", timeout=60_000)
    return page.get_attribute(f"#{panel}", "data-state")


def column(page, panel: str, name: str) -> int:
    """The sum of a column of the panel's rounds table."""
    return page.eval_on_selector(
        f"#{panel}-rounds",
        """(table, name) => {
          const at = [...table.rows[0].cells].findIndex(c => c.textContent === name);
          return [...table.rows].slice(1).reduce((n, r) => n + Number(r.cells[at].textContent), 0);
        }""",
        name,
    )


def test_a_linked_run_without_the_key_shows_the_servers_refusal(page, server):
    page.goto(f"{base_url(server)}/playground?prompt=one%20two&autorun=1")
    assert finished(page, "spec") == "error"
    assert "401" in page.text_content("#spec-error")
    assert page.input_value("#prompt") == "one two"


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_a_run_marks_every_token_with_its_source_and_round(page, server, tmp_path, mode):
    page.goto(f"{base_url(server)}/playground")
    page.fill("#prompt", PROMPT)
    page.check(f"input[name=mode][value={mode}]")
    page.fill("#api_key", KEY)
    page.click("#run")
    assert finished(page, "spec") == "done", page.text_content("#spec-error")
    tokens = page.eval_on_selector_all("#spec-output .tok", TOKENS)
    assert page.text_content("#spec-output") == api_text(server, mode == "chat")
    assert [t["i"] for t in tokens] == list(range(len(tokens)))
    assert {t["source"] for t in tokens} == {"draft", "target"}
    assert all(t["drafter"] == "model" for t in tokens if t["source"] == "draft")
    assert {t["kind"] for t in tokens if t["source"] == "target"} <= {"bonus", "correction"}
    rounds = [t["round"] for t in tokens]
    assert rounds == sorted(rounds) and rounds[0] == 1
    table = page.eval_on_selector_all("#spec-rounds tr", "rows => rows.length")
    assert table - 1 == rounds[-1]  # a header row, then one per round
    assert int(page.text_content("#spec-tokens")) == len(tokens)
    assert float(page.text_content("#spec-tps")) > 0
    assert page.text_content("#spec-acceptance").endswith("%")
    assert float(page.text_content("#spec-tau")) >= 1
    assert int(page.text_content("#spec-forwards")) == column(page, "spec", "forwards")
    link = page.get_attribute("#link", "href")
    assert "autorun=1" in link and f"mode={mode}" in link
    page.screenshot(path=tmp_path / "playground.png", full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 10_000


def test_speculation_off_beside_it_gives_the_same_text_from_the_target_alone(
    page, server, tmp_path
):
    page.goto(f"{base_url(server)}/playground?prompt={PROMPT.replace(' ', '%20')}&compare=1")
    page.fill("#api_key", KEY)
    page.click("#run")
    assert finished(page, "spec") == "done", page.text_content("#spec-error")
    assert finished(page, "off") == "done", page.text_content("#off-error")
    page.wait_for_selector("#speedup[data-ratio]")
    on = page.eval_on_selector_all("#spec-output .tok", TOKENS)
    off = page.eval_on_selector_all("#off-output .tok", TOKENS)
    assert page.text_content("#off-output") == page.text_content("#spec-output")
    assert {t["source"] for t in on} == {"draft", "target"}
    assert {(t["source"], t["kind"]) for t in off} == {("target", "bonus")}
    assert column(page, "off", "forwards") == len(off)  # one token a forward
    assert int(page.text_content("#off-forwards")) == len(off)
    assert page.text_content("#off-acceptance") == "0.0%"
    assert float(page.get_attribute("#speedup", "data-ratio")) > 0
    page.screenshot(path=tmp_path / "playground-compare.png", full_page=True)
