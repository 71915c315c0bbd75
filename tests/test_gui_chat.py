"""The Chat view over real chains of the tiny export: streaming through loopback workers and Stop,
history across a rebuilt window, two tabs at once equal to each alone, Regenerate and Copy; and
the real SmolLM2 as `make run` opens it."""

from __future__ import annotations

import re

import pytest
from gui_support import gui_home, open_window, screenshot, settings_store, tiny_settings  # noqa: F401

from engine.config import Settings
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain
from engine.session import Launch, open_service
from fleetgui.backend import EngineBackend


@pytest.fixture(scope="module")
def shards(tiny_exports):
    # the tiny Qwen2 answers each prompt differently (the tiny Llama repeats one token after the
    # chat template, which would hide streams mixing their outputs)
    return tiny_exports["qwen2", "2"].out


def greedy(shards, messages, max_new_tokens):
    """What the chain alone replies: plain greedy decoding, in process."""
    chain = LocalChain([shards])
    ids = ChatTokenizer(chain.first_folder).chat_ids(messages)
    gen = Generator(chain, chain.spec.max_position, chain.manifest.eos_token_ids)
    return gen.generate(ids, max_new_tokens).tokens


class LoopbackBackend(EngineBackend):
    """Stage 1 as a worker process on loopback with a small injected hop delay, so a reply takes
    long enough to be stopped half-way."""

    def open_chat(self, settings, progress=None, cancel=None):
        return open_service(Settings(streams=2, k="0", draft="none"),
                            Launch(shards=self.resolve_shards(settings), workers="processes", delay_ms=3.0))


def send(qtbot, tab, text, timeout=60000):
    tab.input.setPlainText(text)
    with qtbot.waitSignal(tab.finished, timeout=timeout) as blocker:
        tab.send()
    return blocker.args[0]


def test_reply_streams_over_loopback_workers_and_stop_stops_it(qtbot, gui_home, tmp_path, shards):
    settings = tiny_settings(shards, local_workers=True, max_new_tokens=400)
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"), backend=LoopbackBackend())
    tab = window.chat.all_tabs()[0]
    pieces = []
    tab.streamed.connect(lambda piece, tokens: pieces.append((piece, tokens)))
    tab.input.setPlainText("The quick brown fox")
    tab.send()
    assert tab.busy and tab.stop_button.isEnabled() and not tab.send_button.isEnabled()
    # the random model's bytes may hold text back until a character is whole: wait for two pieces
    qtbot.waitUntil(lambda: tab._tokens >= 8 and len(pieces) >= 2, timeout=60000)
    streamed = tab.transcript.toPlainText()
    with qtbot.waitSignal(tab.finished, timeout=30000) as blocker:
        tab.stop_button.click()
    reply = blocker.args[0]

    assert reply.stopped_by == "cancelled" and 8 <= len(reply.tokens) < 400
    assert len(pieces) > 1 and [n for _, n in pieces] == sorted(n for _, n in pieces)  # incremental
    assert "".join(p for p, _ in pieces) == reply.text
    assert reply.text in tab.transcript.toPlainText() and streamed.strip()
    assert "stopped" in tab.stats.text() and "tok/s" in tab.stats.text()
    # the loopback pipeline streamed exactly what the chain decodes greedily, up to the stop
    want = greedy(shards, [{"role": "user", "content": "The quick brown fox"}], 400)
    assert reply.tokens == want[: len(reply.tokens)]
    assert window.service_label.text().startswith("Chat: qwen2, 2 stages, local fleet")
    assert window.chat.live.points("chat 1") > 0 or window.chat.meter.snapshot()["chat 1"] == len(reply.tokens)
    stored = window.history.load(tab.conversation.id)
    assert [m.role for m in stored.messages] == ["user", "assistant"]
    assert stored.messages[1].stats["stopped_by"] == "cancelled"


def test_history_survives_rebuilding_the_window(qtbot, gui_home, tmp_path, shards):
    store = tmp_path / "s.ini"
    window = open_window(qtbot, tiny_settings(shards), settings_store(store))
    tab = window.chat.all_tabs()[0]
    tab.system.setText("Answer briefly.")
    first = send(qtbot, tab, "Paris is the capital of")
    second = send(qtbot, tab, "and Berlin?")
    conversation_id = tab.conversation.id
    window.close()
    assert (gui_home / "data" / "history.sqlite").exists()

    again = open_window(qtbot, tiny_settings(shards), settings_store(store))
    saved = [again.chat.saved.item(i).text() for i in range(again.chat.saved.count())]
    assert saved == ["Paris is the capital of"]
    restored = again.chat.all_tabs()[0]
    assert restored.conversation.id == conversation_id
    assert restored.system.text() == "Answer briefly."
    assert [(m.role, m.content) for m in restored.conversation.messages] == [
        ("user", "Paris is the capital of"), ("assistant", first.text), ("user", "and Berlin?"),
        ("assistant", second.text)]
    assert restored.conversation.messages[1].stats["decode_tok_s"] == first.to_json()["decode_tok_s"]
    assert "and Berlin?" in restored.transcript.toPlainText()
    # the conversation continues where it was: the prompt holds every earlier turn
    third = send(qtbot, restored, "and Rome?")
    want = greedy(shards, restored.conversation.prompt()[:-1], 64)
    assert third.tokens == want


def test_two_tabs_generate_at_once_like_each_alone(qtbot, gui_home, tmp_path, shards):
    window = open_window(qtbot, tiny_settings(shards, max_new_tokens=48), settings_store(tmp_path / "s.ini"))
    a = window.chat.all_tabs()[0]
    b = window.chat.new_chat()
    prompts = {a: "The quick brown fox", b: "def add(a, b):"}
    for tab, text in prompts.items():
        tab.input.setPlainText(text)
    with qtbot.waitSignals([a.finished, b.finished], timeout=60000):
        a.send()
        b.send()
        assert a.busy and b.busy
    assert {a.last_reply.stream, b.last_reply.stream} == {0, 1}  # both in flight at once, one stream each
    for tab, text in prompts.items():
        alone = greedy(shards, [{"role": "user", "content": text}], 48)
        assert tab.last_reply.tokens == alone
        assert tab.last_reply.text == ChatTokenizer(LocalChain([shards]).first_folder).decode(alone)
    assert a.last_reply.tokens != b.last_reply.tokens
    assert window.chat.tabs.count() == 2


def test_regenerate_copy_and_new_chat(qtbot, gui_home, tmp_path, shards):
    from PySide6.QtWidgets import QApplication

    window = open_window(qtbot, tiny_settings(shards, max_new_tokens=24), settings_store(tmp_path / "s.ini"))
    tab = window.chat.all_tabs()[0]
    first = send(qtbot, tab, "A fleet of laptops")
    with qtbot.waitSignal(tab.finished, timeout=60000) as blocker:
        tab.regenerate_button.click()
    again = blocker.args[0]
    assert again.tokens == first.tokens  # greedy: the same reply again, in place of the first
    assert [m.role for m in tab.conversation.messages] == ["user", "assistant"]
    assert [m.role for m in window.history.load(tab.conversation.id).messages] == ["user", "assistant"]
    tab.copy_button.click()
    assert QApplication.clipboard().text() == again.text
    count = window.chat.tabs.count()
    fresh = window.chat.new_chat()
    assert window.chat.tabs.count() == count + 1 and fresh.conversation.messages == []
    window.chat.close_tab(window.chat.tabs.indexOf(fresh))
    assert window.chat.tabs.count() == count


@pytest.fixture(scope="module")
def smollm2_two_stages():
    from engine.export.exporter import export_model

    # module scope: made before a test's own home is set, so it lands in (and reuses) the user's cache
    return export_model("smollm2-135m", stages=2, weights="int4").out


@pytest.mark.real_model
def test_the_default_model_answers_on_a_local_fleet(qtbot, gui_home, tmp_path, smollm2_two_stages):
    """What `make run` opens: SmolLM2-135M, stage 1 in a worker process, prompt lookup with K auto
    (the README's chat screenshot)."""
    from fleetgui.settings import GuiSettings

    settings = GuiSettings(default_model=str(smollm2_two_stages), max_new_tokens=160)
    assert (settings.local_workers, settings.draft, settings.k, settings.stages) == (True, "lookup", "auto", 2)
    window = open_window(qtbot, settings, settings_store(tmp_path / "s.ini"))
    tab = window.chat.all_tabs()[0]
    reply = send(qtbot, tab, "What is the capital of France?", timeout=300000)
    assert reply.stopped_by in ("eos", "max_tokens") and "Paris" in reply.text, (reply.error, reply.text)
    assert window.service_label.text().startswith("Chat: smollm2-135m, 2 stages, local fleet")
    assert re.search(r" · acceptance [0-9.]+ · ", tab.stats.text()), tab.stats.text()
    longer = send(qtbot, tab, "Tell me three facts about Paris.", timeout=300000)
    assert longer.stopped_by in ("eos", "max_tokens") and len(longer.tokens) > 32, (longer.error, longer.text)
    qtbot.waitUntil(lambda: window.chat.live.points("chat 1") >= 3, timeout=10000)  # the live plot sampled it
    screenshot(window, "chat")
