"""The app shell: the window builds with every view, settings persist through QSettings, the
theme switches, engine errors read as messages, and the PySide6 emit workaround holds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gui_support import open_window, screenshot, settings_store, tiny_settings

from engine.errors import StageError
from fleetgui.backend import EngineBackend
from fleetgui.mainwindow import VIEWS


def test_window_builds_and_every_view_shows(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    assert window.windowTitle() == "fleetshard"
    assert not window.windowIcon().isNull()
    assert [window.sidebar.item(i).text() for i in range(window.sidebar.count())] == list(VIEWS)
    for name in VIEWS:
        view = window.show_view(name)
        qtbot.waitUntil(view.isVisible)
        assert window.current_view() == name and window.stack.currentWidget().view() is view
    from fleetgui.fleet_view import FleetView
    from fleetgui.placement_view import PlacementView

    assert isinstance(window.views["Fleet"], FleetView) and isinstance(window.views["Placement"], PlacementView)
    # another widget can take a view's place
    from PySide6.QtWidgets import QLabel

    fleet = QLabel("fleet view")
    window.set_view("Fleet", fleet)
    assert window.show_view("Fleet") is fleet and window.stack.currentWidget().view() is fleet


def test_window_fits_1280x800_and_grows_with_the_font(qtbot, gui_home, tmp_path):
    from PySide6.QtWidgets import QApplication

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    for name in VIEWS:
        window.show_view(name)
        hint = window.minimumSizeHint()
        assert hint.width() <= 1280 and hint.height() <= 800, (name, hint)
    narrow = window.sidebar.width()
    app = QApplication.instance()
    font = app.font()
    try:
        bigger = app.font()
        bigger.setPointSizeF(font.pointSizeF() * 1.5)
        app.setFont(bigger)
        large = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "t.ini"))
        assert large.sidebar.width() > narrow  # sizes follow the font, not fixed pixels
    finally:
        app.setFont(font)


def test_settings_persist_across_a_new_qsettings(qtbot, gui_home, tmp_path):
    from fleetgui.settings import GuiSettings

    path = tmp_path / "settings.ini"
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(path))
    dialog = window.open_settings()
    dialog.key_file.setText(str(tmp_path / "office.key"))
    dialog.model.setCurrentText("qwen2.5-coder-1.5b")
    dialog.k.setCurrentText("5")
    dialog.streams.setValue(3)
    dialog.stages.setValue(3)
    dialog.devices.setText("CPU,GPU.1")  # two devices for three stages: refused with the reason
    assert not dialog.accept()
    assert dialog.isVisible() and "3 stages" in dialog.error.text() and window.settings.stages != 3
    dialog.devices.setText("CPU,CPU,GPU.1")
    dialog.theme.setCurrentText("dark")
    assert dialog.standbys.isChecked()  # on by default
    dialog.standbys.setChecked(False)
    assert dialog.accept() and dialog.error.isHidden()

    loaded = GuiSettings.load(settings_store(path))  # a new QSettings on the same file
    assert loaded.fleet_key_file == str(tmp_path / "office.key")
    assert loaded.default_model == "qwen2.5-coder-1.5b"
    assert (loaded.k, loaded.streams, loaded.stages, loaded.device, loaded.theme) == ("5", 3, 3, "CPU,CPU,GPU.1",
                                                                                       "dark")
    assert loaded == window.settings
    assert loaded.local_workers is False and loaded.max_new_tokens == 64 and loaded.standbys is False


def test_settings_is_a_view_of_the_sidebar_with_each_field_explained(qtbot, gui_home, tmp_path):
    from PySide6.QtWidgets import QFormLayout, QLabel

    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"))
    assert "Settings" in [window.sidebar.item(i).text() for i in range(window.sidebar.count())]
    page = window.open_settings()
    assert window.current_view() == "Settings" and page is window.views["Settings"]
    form = page.findChild(QFormLayout)
    for row in range(form.rowCount()):
        field = form.itemAt(row, QFormLayout.ItemRole.FieldRole).widget()
        notes = [label.text() for label in field.findChildren(QLabel) if label.objectName() == "hint"]
        assert notes and len(notes[0]) > 20, form.itemAt(row, QFormLayout.ItemRole.LabelRole).widget().text()


def test_theme_switches_and_is_kept(qtbot, gui_home, tmp_path):
    from PySide6.QtWidgets import QApplication

    from fleetgui.settings import GuiSettings

    path = tmp_path / "settings.ini"
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(path))
    window.set_theme("dark")
    app = QApplication.instance()
    assert "#1b222c" in app.styleSheet()
    assert app.palette().window().color().name() == "#20262f"
    assert GuiSettings.load(settings_store(path)).theme == "dark"
    window.show_view("Chat")
    screenshot(window, "chat-dark")
    window.set_theme("light")
    assert "#eef2f7" in app.styleSheet()


def test_a_wheel_install_carries_the_icon_and_styles(tmp_path):
    """A wheel (a pip install that is not this checkout) holds resources/ as data files, and the
    theme finds them where pip puts them."""
    import zipfile

    from fleetgui.theme import resources_folder

    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "source"  # pip builds in the tree it is given: a copy, not this checkout
    shutil.copytree(root, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist",
                                                                "tests", "docs", "bench-results"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("fleetshard-*.whl")
    prefix = tmp_path / "prefix"
    with zipfile.ZipFile(wheel) as z:  # what pip installs under the environment's data path
        for name in z.namelist():
            _, _, rest = name.partition(".data/data/")
            if rest:
                (prefix / rest).parent.mkdir(parents=True, exist_ok=True)
                (prefix / rest).write_bytes(z.read(name))
    found = resources_folder(tmp_path / "no-checkout", [tmp_path / "elsewhere", prefix])
    assert found == prefix / "share" / "fleetshard"
    assert sorted(p.relative_to(found).as_posix() for p in found.rglob("*.*")) == sorted(
        p.relative_to(root / "resources").as_posix() for p in (root / "resources").rglob("*.*"))


class FailingBackend(EngineBackend):
    def open_chat(self, settings, progress=None, cancel=None):
        raise StageError(1, "10.0.0.7:5001", "connection lost")


def test_engine_errors_read_as_messages_not_tracebacks(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "none"), settings_store(tmp_path / "s.ini"),
                         backend=FailingBackend())
    tab = window.chat.all_tabs()[0]
    tab.input.setPlainText("hello")
    with qtbot.waitSignal(tab.finished, timeout=10000) as blocker:
        tab.send()
    assert blocker.args[0].stopped_by == "error"
    banner = window.chat.banner.message
    assert "stage 1 at 10.0.0.7:5001: connection lost" in banner
    assert "Traceback" not in banner and "StageError" not in banner
    qtbot.waitUntil(lambda: window.service_label.text() == "Chat: none on this PC did not start", timeout=5000)
    assert not tab.busy and tab.send_button.isEnabled()


def test_a_missing_model_is_reported_plainly(qtbot, gui_home, tmp_path):
    window = open_window(qtbot, tiny_settings(tmp_path / "does-not-exist"), settings_store(tmp_path / "s.ini"))
    tab = window.chat.all_tabs()[0]
    tab.input.setPlainText("hello")
    with qtbot.waitSignal(tab.finished, timeout=10000):
        tab.send()
    assert "does not exist" in window.chat.banner.message


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="booleans are immortal from Python 3.12")
def test_signal_emits_keep_the_reference_count_of_true(qapp):
    from PySide6.QtCore import QObject, Signal

    import fleetgui  # noqa: F401  (installs the workaround when this PySide6 needs it)

    class Source(QObject):
        fired = Signal(int)

    source = Source()
    source.fired.connect(lambda _: None)
    before = sys.getrefcount(True)
    for _ in range(1000):
        source.fired.emit(1)
    assert sys.getrefcount(True) - before >= 0


def test_garbage_made_on_an_engine_thread_is_collected_on_the_gui_thread(qtbot, qapp):
    import gc
    import threading

    from fleetgui import qtfix

    freed_on = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            freed_on.append(threading.current_thread().name)

    kept = []

    def engine_work():
        Cycle()
        kept.extend([] for _ in range(20_000))  # live objects past every generation's threshold

    gc.enable()
    timer = qtfix.collect_on_gui_thread(qapp, interval_ms=50)
    try:
        worker = threading.Thread(target=engine_work, name="engine")
        worker.start()
        worker.join()
        qtbot.waitUntil(lambda: bool(freed_on), timeout=10000)
        assert freed_on == [threading.main_thread().name]
    finally:
        timer.stop()
        gc.disable()
        kept.clear()
