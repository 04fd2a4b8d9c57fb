"""The chat page in a real headless Chromium (Debian's, driven by Playwright): a typed message gets a
reply that streams into the page, survives reloads, can be retried and edited, and stays cleared (even mid-reply). Saves a screenshot (``GEMMA4_SCREENSHOT=path`` keeps it)."""

import os
import shutil
import time

import pytest
from test_app import endless_replies, launch

from app.backend import ModelHolder

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs a Chromium binary (Debian: apt install chromium; .ci/run installs it)"
)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


def test_reply_streams_into_the_page(tmp_path):
    from playwright.sync_api import sync_playwright

    holder = ModelHolder(None, None, demo=True).start()
    app, url = launch(holder)
    try:
        assert holder.ready.wait(120)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(url)
            page.wait_for_selector("#status:has-text('Ready')", timeout=60_000)
            box = page.locator("#input textarea")
            box.fill("Hello Gemma! Say something.")
            box.press("Enter")
            bot = page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']").first
            bot.wait_for(timeout=60_000)
            lengths = []
            for _ in range(40):  # the reply grows while it streams
                lengths.append(len(page.locator("#chatbot").inner_text()))
                if page.locator("#chatbot").get_by_text("tok/s").count():
                    break
                time.sleep(0.05)
            page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=60_000)
            assert "Hello Gemma! Say something." in page.locator("#chatbot").inner_text()
            assert len(set(lengths)) > 1 or lengths[-1] > 0
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot))
            # The conversation survives a page reload (kept in the browser's local storage).
            # Twice: the first restore must not erase what the second one reads.
            chat = page.locator("#chatbot")
            for _ in range(2):
                page.reload()
                chat.get_by_text("Hello Gemma! Say something.").wait_for(timeout=60_000)
            # The retry icon under the reply answers again, in place.
            stats = lambda: chat.get_by_text("tok/s").all_inner_texts()  # noqa: E731 (times differ on every reply)
            before = stats()
            chat.locator("button[aria-label='Retry']").click()
            _wait_until(lambda: len(stats()) == 1 and stats() != before)
            assert chat.get_by_text("Hello Gemma! Say something.").count() == 1
            # Editing the message replaces it and answers the new text.
            before = stats()
            chat.locator("button[aria-label='Edit']").click()
            chat.locator("textarea").first.fill("An edited question")
            chat.locator("button[aria-label='Submit']").click()
            _wait_until(lambda: chat.get_by_text("An edited question").count() == 1 and len(stats()) == 1 and stats() != before)
            assert chat.get_by_text("Hello Gemma! Say something.").count() == 0
            # Clear during a reply stops it, and the chat stays empty: the reply's last update must
            # not bring the messages back, and a reload must not restore them.
            with endless_replies(holder.engine):
                box.fill("Tell me everything.")
                box.press("Enter")
                _wait_until(lambda: len(chat.inner_text()) > len("An edited question") + 200)  # streaming
                page.locator("#clear").click()
                _wait_until(lambda: chat.get_by_text("An edited question").count() == 0)
                page.wait_for_timeout(2000)  # time for a late reply update to (wrongly) refill the chat
                assert chat.get_by_text("Tell me everything.").count() == 0
            page.reload()
            page.wait_for_selector("#status:has-text('Ready')", timeout=60_000)
            page.wait_for_timeout(2000)  # the restore is one request; time for it to (wrongly) refill the chat
            assert chat.get_by_text("An edited question").count() == 0
            browser.close()
        assert shot.stat().st_size > 10_000
        if os.environ.get("GEMMA4_SCREENSHOT"):
            shutil.copy(shot, os.environ["GEMMA4_SCREENSHOT"])
    finally:
        app.close()


def _wait_until(condition, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while not condition():
        assert time.time() < end, "the page did not get there in time"
        time.sleep(0.1)
