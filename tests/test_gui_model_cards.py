"""Model cards in the Export wizard and the chat's model browser: a card per catalog model with its
facts, whether it fits this PC and the fleet and its predicted speed from the fleet profile in the
data folder (or a request to profile), the last measured speed, and a GGUF dropped on the window."""

from __future__ import annotations

import json

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QTimer, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication

from gui_support import open_window, screenshot, settings_store, tiny_settings
from test_fit import profile_doc, write_gguf

from engine.config import paths
from engine.fleet import fit
from engine.models.catalog import CATALOG
from engine.models.facts import catalog_facts


def _priced(qtbot, cards) -> None:
    with qtbot.waitSignal(cards.priced, timeout=60000):
        cards.refresh()


def test_a_card_per_catalog_model_asks_for_a_profile(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.show_view("Export")
    cards = wizard.cards
    assert [cards.item(i).data(Qt.ItemDataRole.UserRole) for i in range(cards.count())] == list(CATALOG)
    _priced(qtbot, cards)
    smol = cards.card_text("smollm2-135m").splitlines()
    assert smol[0] == ("smollm2-135m — 94 MB · 135M parameters · GGUF Q4_1 · 8K context · license Apache-2.0 · "
                       + ("cached" if "cached" in smol[0] else "not downloaded yet"))
    assert "1.5B parameters" in cards.card_text("qwen2.5-coder-1.5b")
    assert "license Gemma Terms of Use" in cards.card_text("gemma3-270m")
    for name in CATALOG:
        text = cards.card_text(name)
        assert "this PC" in text and "Profile the fleet to predict speed" in text and "tok/s" not in text
    assert cards.current_source() == "smollm2-135m" and wizard.source() == "smollm2-135m"
    wizard.choose_catalog("gemma3-270m")
    assert wizard.source() == "gemma3-270m" and wizard.catalog_radio.isChecked()


def test_cards_predict_from_the_fleet_profile_and_show_the_measured_speed(qtbot, gui_home, tmp_path):
    paths().data.mkdir(parents=True, exist_ok=True)
    (paths().data / fit.PROFILE_NAME).write_text(json.dumps(profile_doc()))
    fit.record_measured("smollm2-135m", 23.4)
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.show_view("Export")
    _priced(qtbot, wizard.cards)
    profile = fit.load_profile(paths().data / fit.PROFILE_NAME)
    big = fit.predict(catalog_facts(CATALOG["qwen2.5-coder-1.5b"]), profile)
    lines = wizard.cards.card_text("qwen2.5-coder-1.5b").splitlines()
    assert lines[2].startswith("Does not fit this PC (needs 1.") and lines[2].endswith("needs 2 of the fleet's 3 PCs")
    assert lines[3] == f"Predicted {big.tok_s_1:.1f} tok/s for 1 user, {big.tok_s_users:.1f} tok/s for 4 users"
    smol = wizard.cards.card_text("smollm2-135m").splitlines()
    assert smol[2].startswith("Fits this PC") and smol[2].endswith("needs 1 of the fleet's 3 PCs")
    assert smol[3].startswith("Predicted ") and smol[3].endswith(" · measured 23.4 tok/s")
    item = wizard.cards.item(1)
    assert "predictions of the placement solver" in item.toolTip() and "estimated" in item.toolTip()
    # no KL on the card itself: it stands in the card's details (its tooltip)
    wizard.cards.weights = "auto"
    wizard.cards.render()
    smol_item = wizard.cards.item(list(CATALOG).index("smollm2-135m"))
    assert "Exports with same answers as the GGUF" in smol_item.text() and "KL" not in smol_item.text()
    assert "KL 0.002 nats" in smol_item.toolTip()
    screenshot(window, "export-cards")

    # a profile of simulated PCs (the demo fleet's) gives predictions that say so
    doc = profile_doc()
    doc["nodes"]["b"]["simulated"] = True
    (paths().data / fit.PROFILE_NAME).write_text(json.dumps(doc))
    _priced(qtbot, wizard.cards)
    assert wizard.cards.card_text("qwen2.5-coder-1.5b").splitlines()[3].endswith(
        "(on simulated PCs: real ones will differ)")


def _drag(window, path) -> QDragEnterEvent:
    """A drag of ``path`` entering the window (Qt delivers a drop only after an accepted enter)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    enter = QDragEnterEvent(QPoint(50, 50), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    enter._mime = mime  # keep the data alive as long as the event
    QApplication.sendEvent(window, enter)
    return enter


def test_a_gguf_dropped_on_the_window_gets_a_card_and_is_the_source(qtbot, gui_home, tmp_path, monkeypatch):
    """The dropped file's header is read on a worker thread (a slow disk must not freeze the window):
    the wizard says it is checking it meanwhile, and the card (or what is wrong) shows on the GUI thread."""
    import threading

    from fleetgui import model_cards

    read_on = []
    facts_of = model_cards.facts_of
    monkeypatch.setattr(model_cards, "facts_of", lambda source: read_on.append(threading.current_thread())
                        or facts_of(source))
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    window.show_view("Chat")
    gguf = write_gguf(tmp_path / "tiny.gguf")
    assert not _drag(window, tmp_path / "notes.txt").isAccepted()  # only models are taken
    mime = _drag(window, gguf).mimeData()
    drop = QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    wizard = window.export
    with qtbot.waitSignal(wizard.checked, timeout=30000) as checked:
        QApplication.sendEvent(window, drop)
        assert drop.isAccepted() and window.current_view() == "Export"
        assert wizard.banner.message == "Checking tiny.gguf…" and not wizard.next_button.isEnabled()
    assert checked.args == [True] and read_on and threading.main_thread() not in read_on
    assert wizard.banner.message == "" and wizard.next_button.isEnabled() and wizard.checking == ""
    assert wizard.gguf_radio.isChecked() and wizard.source() == str(gguf)
    text = wizard.cards.card_text(str(gguf))
    assert text.startswith("tiny test llama — ") and "2K context" in text and "license mit" in text
    assert "GGUF F16" in text and wizard.cards.current_source() == str(gguf)
    # a float GGUF has no codes to carry: auto exports it Fast, and the card says so
    wizard.cards.weights = "auto"
    wizard.cards.render()
    assert "\nExports with faster, slightly different answers — " in wizard.cards.card_text(str(gguf))
    assert "this file's weight types cannot be kept as they are" in wizard.cards.card_text(str(gguf))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    with qtbot.waitSignal(wizard.checked, timeout=30000) as checked:
        wizard.use_path(tmp_path / "broken.gguf")
    assert checked.args == [False] and "corrupt GGUF" in wizard.banner.message
    assert wizard.source() == str(gguf)  # a dropped file that cannot be read leaves the source as it was
    with qtbot.waitSignal(wizard.checked, timeout=30000):  # browsed to: it stays in its field, the error said
        wizard.use_path(tmp_path / "broken.gguf", wizard.gguf_radio)
    assert wizard.source() == str(tmp_path / "broken.gguf") and "corrupt GGUF" in wizard.banner.message


def test_a_typed_gguf_path_is_read_off_the_gui_thread_before_its_choices(qtbot, gui_home, tmp_path, monkeypatch):
    """Next on a GGUF path typed into its field reads the file on a worker thread, as a dropped one,
    then shows its choices; a path that cannot be read stays on the first step, saying why."""
    import threading

    from fleetgui import model_cards

    read_on = []
    facts_of = model_cards.facts_of
    monkeypatch.setattr(model_cards, "facts_of", lambda source: read_on.append(threading.current_thread())
                        or facts_of(source))
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    wizard = window.export
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    wizard.gguf_path.setText(str(tmp_path / "broken.gguf"))
    wizard.gguf_radio.setChecked(True)
    with qtbot.waitSignal(wizard.checked, timeout=30000) as checked:
        wizard.next()
        assert wizard.banner.message == "Checking broken.gguf…" and wizard.pages.currentIndex() == 0
    assert checked.args == [False] and "corrupt GGUF" in wizard.banner.message and wizard.pages.currentIndex() == 0
    gguf = write_gguf(tmp_path / "tiny.gguf")
    wizard.gguf_path.setText(str(gguf))
    with qtbot.waitSignal(wizard.checked, timeout=30000) as checked:
        wizard.next()
        assert wizard.pages.currentIndex() == 0 and not wizard.next_button.isEnabled()
    assert checked.args == [True] and wizard.pages.currentIndex() == 1
    assert read_on and threading.main_thread() not in read_on
    assert not wizard.choice_box.isVisibleTo(wizard)  # a float GGUF has no codes to carry over


def test_the_chat_model_browser_picks_a_card(qtbot, gui_home, tmp_path):
    from fleetgui.model_cards import ModelBrowser

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    chat = window.chat
    dialog = ModelBrowser(chat.controller.tasks, chat.settings.default_model, parent=chat)
    assert dialog.cards.count() == len(CATALOG)
    dialog.cards.select("gemma3-270m")
    chosen = []
    chat.model_chosen.connect(chosen.append)
    QTimer.singleShot(0, dialog.accept)
    chat.model_chosen.disconnect(window.chat_uses)  # the choice itself, without opening that model
    assert chat.browse_models(dialog) == "gemma3-270m" and chosen == ["gemma3-270m"]


def test_the_model_browser_is_deleted_each_time_it_closes(qtbot, gui_home, tmp_path):
    """Opening the chat's model browser (its Models… button) and closing it, twice, leaves no dialog
    behind in the chat view: each is deleted once it closes."""
    from PySide6.QtWidgets import QDialog

    from fleetgui.model_cards import ModelBrowser

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    chat = window.chat
    opened = []

    def close_it():
        (dialog,) = [d for d in chat.findChildren(ModelBrowser) if d.isVisible()]
        opened.append(dialog)
        qtbot.waitUntil(lambda: not dialog.looking, timeout=30000)  # its own models read: their task is done
        dialog.reject()

    for _ in range(2):
        QTimer.singleShot(0, close_it)
        assert chat.browse_models() is None
    assert len(opened) == 2 and opened[0] is not opened[1]
    qtbot.waitUntil(lambda: not chat.findChildren(QDialog), timeout=5000)



def test_the_model_browsers_search_field_filters_the_models(qtbot, gui_home, tmp_path):
    """Typing in the browser's search field (as a user types, key by key) leaves the cards of the
    models that match every word; the selection follows to a shown card; nothing matching says so
    and picks nothing; clearing it shows every model again."""
    from PySide6.QtTest import QTest

    from fleetgui.model_cards import ModelBrowser

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    dialog = ModelBrowser(window.chat.controller.tasks, "smollm2-135m", parent=window.chat)
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    cards = dialog.cards

    def shown():
        return [cards.facts[i].source for i in range(cards.count()) if not cards.item(i).isHidden()]

    assert dialog.search.isVisible() and len(shown()) == len(CATALOG)
    QTest.keyClicks(dialog.search, "QWEN coder")
    assert shown() == [n for n in CATALOG if n.startswith("qwen2.5-coder")] and len(shown()) == 2
    assert dialog.chosen_source() in shown() and not dialog.nothing.isVisible()  # smollm2 hid: the first shown
    dialog.search.setText("gemma")
    assert shown() == ["gemma3-270m"] and dialog.chosen_source() == "gemma3-270m"
    dialog.search.setText("no such model")
    assert shown() == [] and dialog.nothing.isVisible() and "no such model" in dialog.nothing.text()
    assert dialog.chosen_source() is None and not dialog.ok.isEnabled()
    dialog.search.clear()
    assert len(shown()) == len(CATALOG) and dialog.ok.isEnabled() and not dialog.nothing.isVisible()

def test_a_chat_reply_becomes_the_cards_measured_speed(qtbot, gui_home, tmp_path):
    from engine.runtime.decode.service import Reply

    window = open_window(qtbot, tiny_settings(tmp_path / "none", default_model="gemma3-270m"),
                         settings_store(tmp_path / "s.ini"))
    tab = window.chat.tab(window.chat.tabs.currentIndex())
    tab.finished.emit(Reply("hi there", [1, 2, 3], 5, "eos", decode_tok_s=0.0, error="boom"))
    assert fit.measured_tok_s("gemma3-270m") is None  # a failed reply measures nothing
    tab.finished.emit(Reply("hi there", [1, 2, 3], 5, "eos", decode_tok_s=41.26))
    assert fit.measured_tok_s("gemma3-270m") == 41.26
    wizard = window.show_view("Export")
    qtbot.waitUntil(lambda: "measured 41.3 tok/s" in wizard.cards.card_text("gemma3-270m"), timeout=60000)
    assert "measured" not in wizard.cards.card_text("smollm2-135m")


def test_a_ggufs_card_says_how_it_exports_and_what_the_other_choice_costs(tmp_path):
    """The same answers as the GGUF (auto, gguf) or faster, slightly different ones (int4), in words
    on the card; the KL measured on the model (or on the reference model for a GGUF of the user's
    own) in its details.  A Hugging Face folder and other formats get no such line."""
    import dataclasses

    from fleetgui.model_cards import export_details, export_line

    smol = catalog_facts(CATALOG["smollm2-135m"])
    assert export_line(smol, "auto") == export_line(smol, "gguf") == \
        "Exports with same answers as the GGUF (faster, slightly different answers: in the Export wizard)"
    assert export_line(smol, "int4").startswith("Exports with faster, slightly different answers")
    assert "KL" not in export_line(smol, "auto") + export_line(smol, "int4")
    assert "KL 0.002 nats against Fast's 0.32." in export_details(smol, "auto")
    own = dataclasses.replace(smol, source=str(tmp_path / "own.gguf"), kind="gguf")
    assert "KL 0.0006 nats against Fast's 0.064 on qwen2.5-coder-1.5b" in export_details(own, "auto")
    assert export_line(dataclasses.replace(smol, kind="hf"), "auto") is None and export_line(smol, "int8") is None
    assert export_line(own, "auto", carries_weights=False).startswith(
        "Exports with faster, slightly different answers — quantized again")
    assert "it will fail (this file's weight types cannot be kept" in export_line(own, "gguf", carries_weights=False)


def test_the_card_of_the_largest_model_the_fleet_runs_at_reading_speed_says_it_is_the_best(qtbot, gui_home,
                                                                                             tmp_path):
    """"Best for your fleet" goes to the largest model predicted at reading speed for one person; a
    draft model is never suggested, and a faster fleet moves the suggestion to a larger model."""
    from engine.fleet.fit import Fit
    from fleetgui.model_cards import BEST_LINE, READING_TOK_S

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    cards = window.show_view("Export").cards

    def priced(speeds: dict[str, float]) -> list[str]:
        fits = {name: Fit(name, 1, 2, True, 2, 1, tok_s, None, "", False) for name, tok_s in speeds.items()}
        cards._priced((fits, False))
        return [name for name in CATALOG if cards.card_text(name).splitlines()[-1] == BEST_LINE]

    slow = READING_TOK_S / 2
    # the 1.5B too slow to read, its 0.5B draft fast (never suggested): Gemma 3 270M, larger than SmolLM2
    assert priced({"smollm2-135m": 60.0, "gemma3-270m": 30.0, "qwen2.5-coder-0.5b": 20.0,
                   "qwen2.5-coder-1.5b": slow}) == ["gemma3-270m"]
    assert priced({"smollm2-135m": 60.0, "gemma3-270m": 30.0, "qwen2.5-coder-0.5b": 20.0,
                   "qwen2.5-coder-1.5b": READING_TOK_S * 1.5}) == ["qwen2.5-coder-1.5b"]
    assert priced({name: slow for name in CATALOG}) == []  # nothing at reading speed: no suggestion
    assert priced({}) == []  # no profile: no suggestion


def test_the_model_browser_finds_the_users_own_models_and_searches_them(qtbot, gui_home, tmp_path):
    """GGUF files in the downloads folder and the app's models folder get cards beside the catalog's
    (a file that is not a GGUF inside, or the catalog's own file, does not); the search finds them."""
    from fleetgui.model_cards import ModelBrowser, model_folders

    downloads = gui_home / "Downloads"
    assert model_folders() == [downloads, paths().models]
    downloads.mkdir(parents=True)
    paths().models.mkdir(parents=True, exist_ok=True)
    write_gguf(downloads / "my-tiny-chat.gguf", license="mit")
    write_gguf(paths().models / "shelved.gguf")
    (downloads / "broken.gguf").write_bytes(b"not a gguf")
    write_gguf(paths().models / CATALOG["smollm2-135m"].filename)  # the catalog's own: its card is the catalog's
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    dialog = ModelBrowser(window.chat.controller.tasks, "smollm2-135m", parent=window.chat)
    qtbot.addWidget(dialog)
    qtbot.waitUntil(lambda: not dialog.looking, timeout=30000)  # read off the GUI thread
    sources = [f.source for f in dialog.cards.facts]
    assert sources[:len(CATALOG)] == list(CATALOG) and len(sources) == len(CATALOG) + 2
    assert {str(downloads / "my-tiny-chat.gguf"), str(paths().models / "shelved.gguf")} == set(sources[len(CATALOG):])
    dialog.search.setText("my-tiny")
    shown = [dialog.cards.facts[i].source for i in range(dialog.cards.count()) if not dialog.cards.item(i).isHidden()]
    assert shown == [str(downloads / "my-tiny-chat.gguf")] and dialog.chosen_source() == shown[0]


def test_the_model_browser_reads_the_users_own_models_off_the_gui_thread(qtbot, gui_home, tmp_path, monkeypatch):
    """The browser opens on the catalog's cards at once; the user's own models (their headers read,
    which a slow disk or a large folder makes take long) are read on a worker thread and join them."""
    import threading

    from fleetgui import model_cards
    from fleetgui.model_cards import ModelBrowser

    (gui_home / "Downloads").mkdir(parents=True)
    write_gguf(gui_home / "Downloads" / "my-tiny-chat.gguf")
    read_on = []
    found_models = model_cards.found_models
    monkeypatch.setattr(model_cards, "found_models",
                        lambda folders: read_on.append(threading.current_thread()) or found_models(folders))
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    dialog = ModelBrowser(window.chat.controller.tasks, "smollm2-135m", parent=window.chat)
    qtbot.addWidget(dialog)
    assert [f.source for f in dialog.cards.facts] == list(CATALOG) and dialog.cards.current_source() == "smollm2-135m"
    with qtbot.waitSignal(dialog.found, timeout=30000):
        pass
    assert not dialog.looking and read_on and threading.main_thread() not in read_on
    assert [f.source for f in dialog.cards.facts] == [*CATALOG, str(gui_home / "Downloads" / "my-tiny-chat.gguf")]
    assert dialog.cards.current_source() == "smollm2-135m"  # the selection stays where it was
