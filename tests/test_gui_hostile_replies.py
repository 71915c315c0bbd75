"""A reply is untrusted text: whatever a model writes, the chat window loads no resource, shows no
HTML of the reply's, offers none of its own actions from the reply's links, and opens a saved chat
holding such a reply at start without harm."""

from __future__ import annotations

import pytest
from gui_support import open_window, settings_store, tiny_settings
from PySide6.QtCore import QUrl

from fleetgui.history import Message
from fleetgui.markdown import REPLY_LINK, RUN, Transcript, message_html

GALLERY = {
    "file image": "Look: ![x](file:///dev/zero)",
    "web image": "![tracker](http://203.0.113.9/pixel.png)",
    "share image": "![creds](file://attacker/share/a.png) and ![smb](smb://attacker/share/b.png)",
    "data image": "![d](data:image/png;base64,iVBORw0KGgo=)",
    "html image": "<img src='file:///dev/zero'> and <p style='color:red'>red</p>",
    "raw html": "<a href='delete:0'>Delete</a> <script>alert(1)</script> <b>bold</b>",
    "action links": "[Sources](edit:0) [More](delete:0) [Again](regenerate:) [Code](copycode:0:0) [c](copy:0)",
    "reference links": "[Sources][x]\n\n[x]: delete:0",
    "autolink": "<delete:0> and https://example.com/page",
    "long line": "a" * 1_000_000,
    "deep nesting": ">" * 10_000 + " deep",
    "deep lists": "".join("  " * i + "- a\n" for i in range(2000)),
}


class Spy(Transcript):
    loaded: list = []

    def loadResource(self, kind, name):  # noqa: N802 (Qt's name)
        Spy.loaded.append(name.toString())
        return super().loadResource(kind, name)


@pytest.mark.parametrize("name", list(GALLERY))
def test_a_hostile_reply_renders_as_text_and_links_only(name, qtbot):
    html = message_html(GALLERY[name], 1)
    assert "<img" not in html and "<script" not in html.lower()
    browser = Spy()
    qtbot.addWidget(browser)
    Spy.loaded.clear()
    browser.setHtml(html)
    browser.resize(600, 400)
    browser.show()
    qtbot.wait(10)
    assert Spy.loaded == []  # a resource of any scheme would have been asked for here
    formats = list(_fragments(browser.document()))
    assert not any(fmt.isImageFormat() for fmt in formats)
    hrefs = [fmt.anchorHref() for fmt in formats if fmt.isAnchor()]
    assert all(h.startswith(REPLY_LINK) for h in hrefs), hrefs


def test_a_long_unbroken_run_gets_break_points_between_tags_only(qtbot):
    url = "https://example.com/" + "b" * 3 * RUN
    html = message_html(f"[x]({url}) {'c' * 3 * RUN} &amp{'d' * 2 * RUN}", 0)
    browser = Transcript()
    qtbot.addWidget(browser)
    browser.setHtml(html)
    shown = browser.toPlainText()
    assert max(len(run) for run in shown.replace("\u200b", " ").split()) <= RUN
    assert shown.replace("\u200b", "") == f"x {'c' * 3 * RUN} &amp{'d' * 2 * RUN}"
    hrefs = [f.anchorHref() for f in _fragments(browser.document()) if f.isAnchor()]
    assert hrefs == [REPLY_LINK + QUrl.toPercentEncoding(url).data().decode()]  # the link is whole


def _fragments(document):
    """The character formats of ``document``'s fragments, in order."""
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            yield it.fragment().charFormat()
            it += 1
        block = block.next()


def test_links_in_a_reply_never_act_and_a_saved_hostile_chat_opens(qtbot, gui_home, tmp_path, monkeypatch):
    import fleetgui.chat.tab

    store = tmp_path / "s.ini"
    first = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(store))
    cid = first.history.create("hostile")
    first.history.append(cid, Message("user", "tell me"))
    reply = "\n\n".join(GALLERY.values())
    first.history.append(cid, Message("assistant", reply, {"new_tokens": 9, "stopped_by": "eos"}))
    view = first.chat
    view.conversations_changed()
    item = view.saved.item([view.saved.item(i).text() for i in range(view.saved.count())].index("hostile"))
    view.saved.itemClicked.emit(item)
    first.close()
    # the newest chat opens at start: the window comes up with the hostile reply in view
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(store))
    tab = window.chat.tabs.currentWidget()
    assert tab.conversation.id == cid and "deep" in tab.transcript.toPlainText()
    asked, opened = [], []
    monkeypatch.setattr(fleetgui.chat.tab, "ask",
                        lambda parent, title, question, action: asked.append(question) or True)
    monkeypatch.setattr(fleetgui.chat.tab.QDesktopServices, "openUrl", lambda url: opened.append(url.toString()))
    for href in ("delete:0", "edit:0", "regenerate:", "copy:0", "copycode:0:0", "file:///dev/zero"):
        tab._link(QUrl(REPLY_LINK + QUrl.toPercentEncoding(href).data().decode()))
    assert [m.role for m in tab.conversation.messages] == ["user", "assistant"] and not tab.input.toPlainText()
    assert asked == [] and opened == []  # no action, and only a web link is ever offered
    tab._link(QUrl(REPLY_LINK + "https%3A%2F%2Fexample.com%2Fpage"))
    assert len(asked) == 1 and opened == ["https://example.com/page"]
