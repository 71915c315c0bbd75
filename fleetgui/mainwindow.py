"""The main window: a sidebar of views (Fleet, Placement, Chat, Export, Benchmarks, Settings), a
status bar and the theme.  ``set_view`` swaps another widget in for a view.  A plan the
Placement view deploys becomes the chain the chat runs on, connected at once.  What runs (the
deployment, the chat's chain, the API, the nodes) is one ``fleetgui.running.Running``: the window
feeds it from the controllers owning each fact, the status bar and the views read it.  A
``.gguf`` file or a Hugging Face folder dropped on the window opens the Export view with that
model's card selected."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from PySide6.QtCore import QSettings, QSize, QTimer
from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QHBoxLayout, QLabel, QListWidget, QMainWindow, QStackedWidget, QWidget

from engine.bench.registry import BENCHES
from fleetgui import theme
from fleetgui.api import ApiController
from fleetgui.bench_panel import BenchPanel
from fleetgui.chat import ChatController, ChatView
from fleetgui.export_wizard import ExportWizard
from fleetgui.fleet_view import FleetView
from fleetgui.help_menu import HelpMenu
from fleetgui.history import HistoryStore
from fleetgui.placement_view import PlacementView
from fleetgui.running import CONNECTED, FAILED, NOT_STARTED, STARTING, Running, model_name
from fleetgui.server_page import ServerPage
from fleetgui.settings import GuiSettings, SettingsPage
from fleetgui.widgets import ViewFrame, plain
from fleetgui.workers import TaskRunner

VIEWS = ("Fleet", "Placement", "Chat", "Export", "Benchmarks", "API server", "Settings")
DEFAULT_SIZE = QSize(1280, 800)


class MainWindow(QMainWindow):
    def __init__(self, settings: GuiSettings, store: QSettings, backend, history: HistoryStore):
        super().__init__()
        self.setWindowTitle("fleetshard")
        self.setWindowIcon(theme.icon())
        self.settings = settings
        self.store = store
        self.backend = backend
        self.history = history
        self.tasks = TaskRunner(self)
        self._shut = False

        self.sidebar = QListWidget()
        self.sidebar.setObjectName("sidebar")
        self.stack = QStackedWidget()
        self.views: dict[str, QWidget] = {}
        self.running = Running(self)
        self._chat_step = ""  # the chat's start-up step now under way
        self._chat_error = ""  # why the chat's chain did not start, until it starts again
        self.chat_controller = ChatController(backend, settings, self.tasks, self)
        self.chat = ChatView(self.chat_controller, history, settings, settings.theme)
        self.chat.node_names = lambda: {n.address: n.name for n in self.running.nodes if n.address}
        self.export = ExportWizard(backend, self.tasks, settings)
        self.bench = BenchPanel(backend, self.tasks, settings)
        self.bench.current = lambda: (self.chat_controller.service, self.chat_controller.deployment)
        self.fleet = FleetView(settings, backend, self.tasks, running=self.running)
        self.placement = PlacementView(settings, backend, self.tasks, agents=self.fleet.agent_addresses,
                                       running=self.running)
        self.settings_page = SettingsPage(settings)
        self.settings_page.saved.connect(self.apply_settings)
        self.api = ApiController(self.chat_controller, settings, self)
        self.server_page = ServerPage(self.api, settings)
        self.server_page.saved.connect(self.apply_settings)
        built = {
            "Fleet": self.fleet,
            "Placement": self.placement,
            "Chat": self.chat,
            "Export": self.export,
            "Benchmarks": self.bench,
            "API server": self.server_page,
            "Settings": self.settings_page,
        }
        for name in VIEWS:
            self.sidebar.addItem(name)
            self.stack.addWidget(ViewFrame(built[name]))  # a view that needs more room scrolls: the window stays
            self.views[name] = built[name]
        self.sidebar.currentRowChanged.connect(self.stack.setCurrentIndex)
        width = max(self.sidebar.sizeHintForColumn(0), self.fontMetrics().horizontalAdvance("Benchmarks")) + \
            self.fontMetrics().averageCharWidth() * 6
        self.sidebar.setFixedWidth(width)  # from the font's metrics: it grows with the system font
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(self.sidebar)
        row.addWidget(self.stack, 1)
        self.setCentralWidget(central)

        self.api.status.connect(self._follow_api)
        self.api.changed.connect(lambda: self.settings_page.show_api_error(self.api.error))
        self.service_label = plain(QLabel())  # the chat's chain: the model, the fleet's nodes
        self.fleet_label = plain(QLabel())  # the nodes and the API
        self.fleet_label.setObjectName("hint")
        self.statusBar().addPermanentWidget(self.fleet_label)
        self.statusBar().addPermanentWidget(self.service_label)
        self.running.changed.connect(self._show_running)
        # the chat's chain, as its controller says (read once the signal's call has finished)
        self.chat_controller.status.connect(self._chat_changed)
        self.chat_controller.service_changed.connect(self._chat_changed)
        self.chat_controller.deployment_changed.connect(self._chat_changed)
        self.chat_controller.progress.connect(self._chat_progress)
        self.chat_controller.failed.connect(self._chat_failed)
        self._follow_chat()
        self.api.start()
        self.chat_controller.fleet_event.connect(lambda text: self.statusBar().showMessage(f"Fleet: {text}", 30000))
        self.export.exported.connect(lambda r: self.statusBar().showMessage(
            f"Exported {model_name(self.export.source())} in {len(r.stages)} part{'s' if len(r.stages) != 1 else ''}",
            10000))
        self.export.use_as_default.connect(self.use_model)
        self.chat.model_chosen.connect(self.chat_uses)  # the chat's pick: Settings keep their default model
        self.fleet.key_changed.connect(self.use_key)
        self.placement.deployed.connect(self.use_deployment)
        self.placement.preparing.connect(self.fleet.model.prepare)
        self.bench.finished.connect(lambda r: self.statusBar().showMessage(
            f"Benchmark finished: {BENCHES[r['bench']].shown_name}" if r else "Benchmark ended without a result",
            10000))
        self._menus()
        self.show_view("Chat")
        # every chat tab open at the last exit comes back
        open_tabs = [int(i) for i in str(store.value("chat/open") or "").split(",") if i.strip().isdigit()]
        current = store.value("chat/current")
        self.chat.restore_tabs(open_tabs, int(current) if str(current or "").isdigit() else None)
        self.chat.speed_plot.setChecked(store.value("chat/speed_plot") != "hidden")
        geometry = store.value("window/geometry")
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(DEFAULT_SIZE)
        self.fit_screen()
        self.setAcceptDrops(True)

    def _menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        settings = QAction("&Settings…", self)
        settings.setShortcut("Ctrl+,")
        settings.triggered.connect(self.open_settings)
        file_menu.addAction(settings)
        demo = QAction("Try a &demo fleet", self)
        demo.setToolTip("start demo nodes on this PC (simulated devices) to try placing a model across PCs")
        demo.triggered.connect(self.try_demo)
        file_menu.addAction(demo)
        file_menu.addSeparator()
        quit_action = QAction("&Quit", self)
        quit_action.setShortcut("Ctrl+Q")
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        view_menu = self.menuBar().addMenu("&View")
        for i, name in enumerate(VIEWS):
            action = QAction(name, self)
            action.setShortcut(f"Ctrl+{i + 1}")
            action.triggered.connect(lambda _=False, n=name: self.show_view(n))
            view_menu.addAction(action)
        view_menu.addSeparator()
        group = QActionGroup(self)
        self.theme_actions = {}
        for name in theme.THEMES:
            action = QAction(f"{name.title()} theme", self, checkable=True)
            action.setChecked(name == self.settings.theme)
            action.triggered.connect(lambda _=False, n=name: self.set_theme(n))
            group.addAction(action)
            view_menu.addAction(action)
            self.theme_actions[name] = action
        self.help_menu = HelpMenu(self)  # About, Documentation, Report a problem

    # --- views ---------------------------------------------------------------------------------------

    def show_view(self, name: str) -> QWidget:
        self.sidebar.setCurrentRow(VIEWS.index(name))
        return self.views[name]

    def fit_screen(self) -> None:
        """Shrinks the window to the screen's free area when it is larger (a small screen, or a
        geometry saved on a bigger one); every view lays itself out at that size."""
        screen = self.screen()
        if screen is None:
            return
        area = screen.availableGeometry()
        if self.width() > area.width() or self.height() > area.height():
            self.resize(min(self.width(), area.width()), min(self.height(), area.height()))

    def try_demo(self) -> None:
        """Shows the Fleet view and starts a demo fleet there (``FleetView.start_demo``)."""
        self.show_view("Fleet")
        self.fleet.start_demo()

    def current_view(self) -> str:
        return VIEWS[self.stack.currentIndex()]

    def set_view(self, name: str, widget: QWidget) -> None:
        """Puts another widget in place of a view."""
        index = VIEWS.index(name)
        old = self.stack.widget(index)
        self.stack.insertWidget(index, ViewFrame(widget))
        self.stack.removeWidget(old)
        old.deleteLater()
        self.views[name] = widget
        self.stack.setCurrentIndex(self.sidebar.currentRow())

    # --- dropped models ------------------------------------------------------------------------------

    @staticmethod
    def dropped_model(mime) -> Path | None:
        """The model a drag carries: a local ``.gguf`` file or a folder with a ``config.json``."""
        for url in mime.urls() if mime.hasUrls() else ():
            path = Path(url.toLocalFile()) if url.isLocalFile() else None
            if path and ((path.is_file() and path.suffix.lower() == ".gguf") or (path / "config.json").is_file()):
                return path
        return None

    def dragEnterEvent(self, event) -> None:
        if self.dropped_model(event.mimeData()) is not None:
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event) -> None:
        self.dragEnterEvent(event)

    def dropEvent(self, event) -> None:
        path = self.dropped_model(event.mimeData())
        if path is None:
            event.ignore()
            return
        event.acceptProposedAction()
        self.show_view("Export")
        self.export.use_path(path)

    # --- settings ------------------------------------------------------------------------------------

    def open_settings(self) -> SettingsPage:
        """Shows the Settings view with the settings in force."""
        self.settings_page.load(self.settings)
        self.show_view("Settings")
        return self.settings_page

    def apply_settings(self, settings: GuiSettings) -> None:
        settings = self.api.apply_settings(settings)  # an API address it cannot serve on is not taken (api.error)
        settings.save(self.store)
        self.settings = settings
        theme.apply(settings.theme)
        self.theme_actions[settings.theme if settings.theme in theme.THEMES else "light"].setChecked(True)
        for view in (self.chat, self.export, self.bench, self.fleet, self.placement, self.settings_page,
                     self.server_page):
            view.apply_settings(settings)
        self._follow_chat()
        self.statusBar().showMessage("Settings saved, but not the API address: the API kept its old one"
                                     if self.api.error and self.api.server else "Settings saved", 5000)

    def set_theme(self, name: str) -> None:
        self.apply_settings(dataclasses.replace(self.settings, theme=name))

    def use_model(self, folder: str) -> None:
        self.apply_settings(dataclasses.replace(self.settings, default_model=folder))
        self.show_view("Chat")
        self.statusBar().showMessage(f"Chat now uses {model_name(folder)} on this PC", 10000)

    def chat_uses(self, source: str) -> None:
        self.show_view("Chat")
        self._follow_chat()
        self.statusBar().showMessage(f"Chat now uses {self.chat.model.currentText()}", 10000)

    def use_key(self, path: str) -> None:
        self.apply_settings(dataclasses.replace(self.settings, fleet_key_file=path))
        self.statusBar().showMessage(f"Fleet key: {path or 'the default key file'}", 10000)

    def use_deployment(self, deployment) -> None:
        """The chat runs on a deployed chain from now on, connected at once, as the Placement view
        says (None: back to the settings' model)."""
        self.running.set_deployment(deployment)
        self.chat_controller.use_deployment(deployment)
        if deployment is not None:
            self.chat_controller.open()
            self.statusBar().showMessage(f"The chat now runs {model_name(deployment.model)} on the fleet", 10000)
        self._follow_chat()

    # --- what runs -----------------------------------------------------------------------------------

    def _chat_changed(self, *_) -> None:
        QTimer.singleShot(0, self._follow_chat)  # the controller's own state is complete once its call returns

    def _chat_progress(self, progress) -> None:
        self._chat_step = progress.text if progress is not None else ""
        self._chat_changed()

    def _chat_failed(self, message: str) -> None:
        self._chat_error = message
        self._chat_changed()

    def _follow_chat(self) -> None:
        """The chat's chain into the running state: its model or deployment, and whether it runs."""
        c = self.chat_controller
        if c.service is not None:
            state, detail = CONNECTED, c.service.description
        elif c.loading:
            self._chat_error = ""
            state, detail = STARTING, self._chat_step
        elif self._chat_error:
            state, detail = FAILED, self._chat_error
        else:
            state, detail = NOT_STARTED, ""
        self.running.set_chat(c.current_model, c.deployment, state, detail)

    def _follow_api(self, text: str) -> None:
        server = getattr(self.api, "server", None)
        self.running.set_api(text, getattr(server, "url", "") if server is not None else "")

    def _show_running(self) -> None:
        r = self.running
        self.service_label.setText(r.chat_text())
        self.fleet_label.setText(r.nodes_text() + (f" · API at {r.api_url}" if r.api_running else ""))

    # --- shutdown ------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Cancels running work, closes the chat service (and its local fleet), stops the deployment
        made in this session, and closes discovery and the history."""
        if self._shut:
            return
        self._shut = True
        self.store.setValue("window/geometry", self.saveGeometry())
        self.store.setValue("chat/open", ",".join(map(str, self.chat.open_ids())))
        self.store.setValue("chat/current", self.chat.current_id() or "")
        self.store.setValue("chat/speed_plot", "shown" if self.chat.speed_plot.isChecked() else "hidden")
        self.store.sync()
        self.fleet.shutdown()
        self.api.stop()
        self.chat.shutdown()
        self.tasks.shutdown()
        self.placement.shutdown()  # after the chat and the tasks: stops the workers this session deployed
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        self.history.close()

    def closeEvent(self, event) -> None:
        self.shutdown()
        super().closeEvent(event)
