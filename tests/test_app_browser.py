"""The chat page in a real headless Chromium (Debian's, driven by Playwright): a typed message gets a
reply that streams into the page, survives reloads, can be retried and edited, and stays cleared
(even mid-reply); conversations survive a server restart with their own settings; Export downloads
the current conversation in one click; the page works at a phone's size, with the send button
turning into Stop. Saves a screenshot (``GEMMA4_SCREENSHOT=path`` keeps it)."""

import json
import os
import shutil
import sys
import threading
import time

import pytest
from gradio_client import Client
from helpers import WEATHER, endless_replies, free_port, launch, scripted, word_replies

from app import store as app_store
from app.backend import ModelHolder

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.usefixtures("app_cache"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium binary (Debian: apt install chromium; .ci/run installs it)"),
]
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
            # A reply that only Stop ends: the page must show it growing, several times, before it ends.
            with endless_replies(holder.engine):
                box.fill("Hello Gemma! Say something.")
                box.press("Enter")
                bot = page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']").first
                bot.wait_for(timeout=60_000)
                lengths = [len(page.locator("#chatbot").inner_text())]
                end = time.time() + 60
                while len(set(lengths)) < 4 and time.time() < end:
                    time.sleep(0.05)
                    lengths.append(len(page.locator("#chatbot").inner_text()))
                assert page.locator("#chatbot").get_by_text("tok/s").count() == 0  # still streaming
                page.locator("#input .stop-button").click()
            page.locator("#chatbot").get_by_text("tok/s").first.wait_for(timeout=60_000)
            assert "Hello Gemma! Say something." in page.locator("#chatbot").inner_text()
            assert len(set(lengths)) >= 4 and lengths == sorted(lengths)  # it grew, step by step
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot))
            # The conversation survives a page reload (kept in the browser's local storage).
            # Twice: the first restore must not erase what the second one reads.
            chat = page.locator("#chatbot")
            for _ in range(2):
                page.reload()
                chat.get_by_text("Hello Gemma! Say something.").wait_for(timeout=60_000)
            # The retry icon under the reply answers again, in place; editing the message replaces
            # it and answers the new text. (Scripted: each reply known, and a random one can end in
            # a tool call, which makes the next message the tool's result.)
            original = holder.engine.stream
            try:
                holder.engine.stream = scripted(holder.engine, "A second answer.")
                chat.locator("button[aria-label='Retry']").click()
                _wait_until(lambda: chat.get_by_text("A second answer.").count() == 1 and len(_stats(page)) == 1, page=page)
                assert chat.get_by_text("Hello Gemma! Say something.").count() == 1
                holder.engine.stream = scripted(holder.engine, "An answer to the edit.")
                chat.locator("button[aria-label='Edit']").click()
                chat.locator("textarea").first.fill("An edited question")
                chat.locator("button[aria-label='Submit']").click()
                _wait_until(lambda: chat.get_by_text("An answer to the edit.").count() == 1 and len(_stats(page)) == 1, page=page)
                assert chat.get_by_text("An edited question").count() == 1 and chat.get_by_text("Hello Gemma! Say something.").count() == 0
                assert chat.get_by_text("A second answer.").count() == 0
            finally:
                holder.engine.stream = original
            # Clear during a reply stops it, and the chat stays empty: the reply's last update must
            # not bring the messages back, and a reload must not restore them.
            with endless_replies(holder.engine):
                box.fill("Tell me everything.")
                box.press("Enter")
                # Streaming (its text may be slow to show: the tiny model writes many empty tokens).
                _wait_until(lambda: chat.get_by_text("Tell me everything.").count() == 1 and holder.engine._running, page=page)
                page.wait_for_timeout(300)
                page.locator("#clear").click()
                _wait_until(lambda: chat.get_by_text("An edited question").count() == 0, page=page)
                page.wait_for_timeout(2000)  # time for a late reply update to (wrongly) refill the chat
                assert chat.get_by_text("Tell me everything.").count() == 0, chat.inner_text()[:300]
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


def _wait_until(condition, timeout: float = 60.0, page=None) -> None:
    end = time.time() + timeout
    while not condition():
        if time.time() >= end:
            seen = "" if page is None else f": the page shows {page.locator('body').inner_text()[-1500:]!r}"
            raise AssertionError("the page did not get there in time" + seen)
        time.sleep(0.1)


def _browser(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)


def _send(page, text):
    box = page.locator("#input textarea")
    box.fill(text)
    box.press("Enter")


def _stats(page):
    return page.locator("#chatbot").get_by_text("tok/s").all_inner_texts()


def _open_sidebar(page):
    slid_in = lambda: (page.locator("#new-chat").bounding_box() or {"x": -1})["x"] >= 0  # noqa: E731
    if not slid_in():
        page.locator("button.toggle-button").first.click()
        _wait_until(slid_in, page=page)
    if not page.locator("#system textarea").is_visible():
        page.locator("#settings").get_by_text("Settings of this conversation").click()
        page.locator("#system textarea").wait_for(state="visible")


def _conversations(page):
    return page.locator("#conversations label").all_inner_texts()


def test_conversations_settings_export_and_restart(tmp_path):
    """Two conversations with their own settings, a rename, Export (one click, the current
    conversation), math and dollar amounts, a tool call's prompt, an error note; then the server
    restarts and the browser finds everything again, and a conversation is deleted."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    holder = ModelHolder(None, None, demo=True).start()
    app, url = launch(holder, port)
    try:
        assert holder.ready.wait(120)
        with sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_context(viewport={"width": 1100, "height": 900}, accept_downloads=True).new_page()
            page.goto(url)
            page.wait_for_selector("#status:has-text('Ready')", timeout=60_000)
            chat = page.locator("#chatbot")
            # Dollar amounts stay text; $...$ math by the usual rule renders (KaTeX).
            original = holder.engine.stream
            holder.engine.stream = scripted(holder.engine, "It costs $5 and $10, and the area is $x^2$.")
            try:
                _send(page, "First conversation")
                _wait_until(lambda: len(_stats(page)) == 1, page=page)
            finally:
                holder.engine.stream = original
            reply = chat.locator(".message.bot").first
            # The page renders the reply's last update (text and math) after the stats line can show.
            _wait_until(lambda: "It costs $5 and $10, and the area is" in reply.inner_text() and reply.locator(".katex").count() == 1, page=page)
            # This conversation's settings: shown above the chat, kept with it.
            _open_sidebar(page)
            page.locator("#system textarea").fill("You are a pirate.")
            page.locator("#thinking input").check()
            page.locator("#system textarea").click()  # back in the box, then out: saved on blur
            page.locator("#conversation-name input").click()
            # Two events (the box's blur, the checkbox's change), each updating the line when it is handled.
            _wait_until(lambda: "You are a pirate." in page.locator("#conversation-settings").inner_text(), page=page)
            _wait_until(lambda: "Thinking: on" in page.locator("#conversation-settings").inner_text(), page=page)
            # A second conversation, with other settings.
            page.locator("#new-chat").click()
            _wait_until(lambda: chat.get_by_text("First conversation").count() == 0, page=page)
            page.locator("#system textarea").fill("Be brief.")
            page.locator("#thinking input").uncheck()
            page.locator("#conversation-name input").click()
            _wait_until(lambda: "Be brief." in page.locator("#conversation-settings").inner_text(), page=page)
            with word_replies(holder.engine, max_tokens=40):  # not a random tool call
                _send(page, "Second conversation")
                _wait_until(lambda: len(_stats(page)) == 1, page=page)
            _wait_until(lambda: sorted(_conversations(page)) == ["First conversation", "Second conversation"], page=page)
            # Export downloads the conversation on screen, on the first click.
            with page.expect_download() as download:
                page.locator("#export").click()
            exported = open(download.value.path(), encoding="utf-8").read()
            assert "**You:** Second conversation" in exported and "First conversation" not in exported
            # Back to the first: its messages and its settings come back.
            page.locator("#conversations label", has_text="First conversation").click()
            chat.get_by_text("First conversation").wait_for()
            assert page.locator("#system textarea").input_value() == "You are a pirate."
            assert page.locator("#thinking input").is_checked()
            assert "You are a pirate." in page.locator("#conversation-settings").inner_text()
            with page.expect_download() as download:
                page.locator("#export").click()
            assert "**You:** First conversation" in open(download.value.path(), encoding="utf-8").read()
            page.locator("#conversation-name input").fill("Pirate talk")
            page.locator("#conversation-name input").press("Enter")
            _wait_until(lambda: "Pirate talk" in _conversations(page), page=page)
            # A tool call: the input box says that the next message is the tool's result.
            holder.engine.stream = scripted(holder.engine, '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>')
            try:
                page.locator("#tools textarea, #tools .cm-content").first.click()
                page.keyboard.insert_text(json.dumps(WEATHER))
                page.locator("#conversation-name input").click()
                _send(page, "Weather in Oslo?")
                _wait_until(lambda: "result of get_weather" in (page.locator("#input textarea").get_attribute("placeholder") or ""), page=page)
            finally:
                holder.engine.stream = original
            # An error is a note of its own (a heading and the whole message), not a reply.
            page.locator("#tools .cm-content").first.click()
            page.keyboard.press("Control+a")
            page.keyboard.insert_text("[not json")
            page.locator("#conversation-name input").click()
            _send(page, "12 degrees")
            note = chat.locator(".app-note-error")
            note.wait_for(timeout=60_000)
            assert note.get_attribute("role") == "alert"
            assert "The tools setting cannot be used" in note.inner_text() and "not valid JSON" in note.inner_text()

            # The server restarts (same port: local storage belongs to the page's address).
            app.close()
            holder2 = ModelHolder(None, None, demo=True).start()
            app, url = launch(holder2, port)
            assert holder2.ready.wait(120)
            # Until the conversation is restored, the page is not "Ready" and the input box is
            # disabled: a message sent earlier would be replaced by the restored conversation.
            restoring, release = threading.Event(), threading.Event()
            normalize = app_store.normalize

            def slow_restore(store):
                if sys._getframe(1).f_code.co_name != "restore":  # another event (a save on unload)
                    return normalize(store)
                app_store.normalize = normalize
                restoring.set()
                release.wait(30)
                return normalize(store)

            app_store.normalize = slow_restore
            try:
                page.reload()
                assert restoring.wait(30)
                assert page.locator("#input textarea").is_disabled()
                assert "Ready" not in page.locator("#status").inner_text()
            finally:
                app_store.normalize = normalize
                release.set()
            page.wait_for_selector("#status:has-text('Ready')", timeout=60_000)
            chat.get_by_text("First conversation").wait_for(timeout=30_000)
            assert page.locator("#input textarea").is_enabled()
            _open_sidebar(page)
            _wait_until(lambda: sorted(_conversations(page)) == ["Pirate talk", "Second conversation"], page=page)
            assert page.locator("#system textarea").input_value() == "You are a pirate."
            page.locator("#conversations label", has_text="Second conversation").click()
            chat.get_by_text("Second conversation").wait_for()
            assert page.locator("#system textarea").input_value() == "Be brief."
            # Delete asks first, then removes the conversation on screen.
            page.locator("#delete").click()
            page.locator("#confirm-delete").click()
            _wait_until(lambda: _conversations(page) == ["Pirate talk"], page=page)
            chat.get_by_text("First conversation").wait_for()
            browser.close()
    finally:
        app.close()


def test_phone_layout_and_send_button_becomes_stop(tmp_path):
    """At 390x844 the input and its send button are on screen with a long conversation; while a
    reply streams the send button is Stop, and pressing it ends the reply."""
    from playwright.sync_api import sync_playwright

    holder = ModelHolder(None, None, demo=True).start()
    app, url = launch(holder)
    try:
        assert holder.ready.wait(120)
        with sync_playwright() as p:
            browser = _browser(p)
            page = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True).new_page()
            page.goto(url)
            page.wait_for_selector("#status:has-text('Ready')", timeout=60_000)
            send, stop = page.locator("#input .submit-button"), page.locator("#input .stop-button")
            assert send.is_visible() and not stop.is_visible()
            chat = page.locator("#chatbot")
            with endless_replies(holder.engine):
                _send(page, "Tell me a long story.")
                stop.wait_for(state="visible", timeout=30_000)
                assert not send.is_visible()
                # Long enough to scroll the chat.
                _wait_until(lambda: chat.locator(".bubble-wrap, .message-wrap").first.evaluate("e => e.scrollHeight") > 900, page=page)
                stop.click()
                send.wait_for(state="visible", timeout=30_000)
            _wait_until(lambda: any("stopped" in s for s in _stats(page)), page=page)
            for element in (page.locator("#input textarea"), send):
                box = element.bounding_box()
                assert box is not None and 0 <= box["y"] and box["y"] + box["height"] <= 844, box
            assert page.evaluate("document.scrollingElement.scrollTop") == 0  # nothing scrolled to get there
            shot = tmp_path / "phone.png"
            page.screenshot(path=str(shot))
            # Stop pressed while the reply waits for the model (an API client's reply runs) stops
            # it as it begins.
            client = Client(url, verbose=False)
            with endless_replies(holder.engine):
                job = client.submit({"text": "go on forever", "files": []}, [], api_name="/chat")
                _wait_until(lambda: len(job.outputs()) >= 3, page=page)  # the API client's reply streams
                _send(page, "Are you there?")
                stop.wait_for(state="visible", timeout=30_000)
                stop.click()
                assert len(holder.engine._running) == 1  # the page's reply has not begun
                client.predict(api_name="/stop")
                job.result(timeout=60)
                _wait_until(lambda: len(_stats(page)) == 2, page=page)
            assert _stats(page)[-1].endswith("· stopped"), _stats(page)[-1]
            assert " 0 tokens, " in _stats(page)[-1] or " 1 tokens, " in _stats(page)[-1], _stats(page)[-1]
            browser.close()
    finally:
        app.close()
