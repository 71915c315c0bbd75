"""Worker mode (``fleetgui --worker``): this PC serves the fleet from the system tray.

The node agent (``engine.fleet.agent.Agent``, Qt-free, its accept loop and mDNS on its own threads)
runs in this process.  The tray icon's menu (or, where there is no system tray, a small window with
the same controls) shows what the node does and which stage it serves, pauses and resumes serving,
turns "Start with the session" on and off (``fleetgui.autostart``), and quits: the agent stops its
workers, says goodbye over mDNS and closes its connections, so the coordinator sees a clean departure.
Calls that block (pausing stops workers, quitting stops the agent) run off the GUI thread.

Activity is live: the agent's own log (shards received, workers started, refused connections), each
stage worker's log as it grows (upstream connections, next-stage links, errors), and the stages it
starts and stops serving; ``WorkerController.counts`` tallies connections, stages served, tokens served (the
agent's status of each worker: it reports them every few seconds while it serves, and as its upstream leaves)
and errors.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (QApplication, QCheckBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
                               QMenu, QPlainTextEdit, QPushButton, QSystemTrayIcon, QVBoxLayout, QWidget)

from engine.config import Settings
from engine.errors import FleetError
from engine.fleet.agent import Agent
from engine.fleet.shardstore import shard_text
from engine.fleetkey import access_of
from engine.manifest import layer_span, part_name
from fleetgui import autostart, keystore, theme
from fleetgui.settings import GuiSettings, default_store
from fleetgui.widgets import Banner, flow_bar, plain, plain_line, unbidi
from fleetgui.workers import TaskRunner, on_signals

log = logging.getLogger(__name__)
DEFAULT_LISTEN = "0.0.0.0:7390"
# what the agent and its workers log when something failed (a refused handshake, a malformed frame, a
# next stage lost or stalled, a connection that broke) ...
FAILURE_WORDS = ("refused", "error", "failed", "lost", "stalled", "malformed", "closing upstream", "traceback")
# ... and when a peer simply left: it closed its connection, or the link was closed or re-routed here
NORMAL_END_WORDS = ("closed the connection", "is closed", "(re-routed)")


def describe_state(agent) -> tuple[str, str]:
    """(status, what it serves) of an agent, in words."""
    if agent is None:
        return "stopped", ""
    serving = [w for w in list(agent.workers.values()) if w.running]
    if agent.paused:
        status = "paused: takes no work"
    elif serving:
        status = "serving"
    else:
        status = {"idle": "idle: waiting for work", "receiving": "receiving a shard",
                  "profiling": "profiling its devices"}.get(agent.activity, agent.activity)
    parts = "; ".join(f"{w.info.get('model')}: {part_name(w.info.get('stage'), w.info.get('stages'))} "
                      f"({layer_span(*w.info['layers'])}) on {w.info.get('device')}" for w in serving)
    return status, parts or "nothing"


def is_failure(line: str) -> bool:
    """Whether an agent or worker log line reports a failure; an upstream leaving ("upstream … gone:
    … closed the connection", "upstream … left") is the normal end of a chat, not an error."""
    text = line.lower()
    return any(w in text for w in FAILURE_WORDS) and not any(w in text for w in NORMAL_END_WORDS)


class WorkerController(QObject):
    """The in-process agent and the controls both front ends share.  It keeps the fleet key file and
    whether the fleet speaks TLS rather than a ``FleetAccess``: the file may be missing and another
    chosen (``use_key``), so the access its agent takes whole is built each time the agent starts."""

    changed = Signal()  # status, stage, shards, paused or autostart changed
    stopped = Signal()  # the agent has stopped (after Quit)
    failed = Signal(str)
    logged = Signal(str)  # a line of the agent's log (emitted on its threads, delivered queued)

    def __init__(self, key_file: Path, *, listen: str = DEFAULT_LISTEN, name: str | None = None,
                 advertise: bool = True, store: Path | None = None, tls: bool = False, poll_ms: int = 1000,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.key_file = Path(key_file)
        self.listen, self.name, self.advertise, self.store, self.tls = listen, name, advertise, store, tls
        self.agent = None
        self.error = ""
        self.stopping = False
        self.tasks = TaskRunner(self)
        self._last = None
        self._tails: dict[str, tuple[Path, int, str]] = {}  # worker id -> (its log, bytes read, stage label)
        self._tokens: dict[str, int] = {}  # worker id -> tokens it served, as the agent last said
        self.counts = {"connections": 0, "parts": 0, "tokens": 0, "errors": 0}
        self.timer = QTimer(self)
        self.timer.setInterval(poll_ms)
        self.timer.timeout.connect(self._poll)

    def start(self) -> bool:
        if self.agent is not None:
            return True
        try:
            self.agent = Agent(self.listen, access=access_of(self.key_file, tls=self.tls), name=self.name,
                               store=self.store, advertise=self.advertise, log=self._log).start()
        except (FleetError, OSError) as exc:
            self.error = str(exc) if isinstance(exc, FleetError) else f"cannot start the node agent: {exc}"
            self.failed.emit(self.error)
            self.changed.emit()
            return False
        self.error = ""
        log.info("node agent %s of fleet %s on %s", self.agent.name, self.agent.fleet_id, self.agent.address)
        self.timer.start()
        self.changed.emit()
        return True

    def _log(self, line: str) -> None:
        log.info("agent: %s", line)
        self._count(line)
        self.logged.emit(line)

    def _count(self, line: str) -> None:
        text = line.lower()
        if "serving upstream" in text or text.startswith("control connection from"):
            self.counts["connections"] += 1
        if "started worker" in text:
            self.counts["parts"] += 1
        if is_failure(text):
            self.counts["errors"] += 1

    def _count_tokens(self) -> None:
        """Tokens served: each worker's count in the agent's status, those of stopped workers kept."""
        for worker in self.agent.worker_status() if self.agent is not None else []:
            self._tokens[worker["id"]] = worker["tokens"]
        self.counts["tokens"] = sum(self._tokens.values())

    def _read_worker_logs(self) -> None:
        """Emits the lines each stage worker wrote to its log since the last poll."""
        workers = dict(self.agent.workers) if self.agent is not None else {}
        for wid, worker in workers.items():
            if wid not in self._tails:
                self._tails[wid] = (Path(worker.log), 0, part_name(worker.info.get("stage"), worker.info.get("stages")))
            path, offset, label = self._tails[wid]
            try:
                with path.open("rb") as f:
                    if os.fstat(f.fileno()).st_size < offset:
                        offset = 0  # the log was rotated (``engine.launch.log_stderr``): a new file
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            complete = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self._tails[wid] = (path, offset + complete, label)
            for raw in data[:complete].decode("utf-8", "replace").splitlines():
                if raw.strip() and not raw.startswith("ready "):
                    self._log(f"{label}: {raw.strip()}")
        for wid in set(self._tails) - set(workers):
            self._log(f"{self._tails.pop(wid)[2]}: worker {wid} stopped")

    def shards(self) -> list[dict]:
        """The shards this node holds (its store's listing)."""
        if self.agent is None:
            return []
        try:
            return self.agent.store.listing()
        except OSError:
            return []

    @property
    def running(self) -> bool:
        return self.agent is not None and not self.stopping

    @property
    def paused(self) -> bool:
        return bool(self.agent and self.agent.paused)

    def state(self) -> tuple[str, str]:
        if self.stopping:
            return "stopping: workers, mDNS goodbye, connections", ""
        if self.agent is None:
            return ("not running: " + self.error) if self.error else "stopped", ""
        return describe_state(self.agent)

    def tally(self) -> str:
        n = self.counts
        return (f"{n['connections']} connection{'s' if n['connections'] != 1 else ''} · {n['parts']} part"
                f"{'s' if n['parts'] != 1 else ''} started · {n['tokens']} token{'s' if n['tokens'] != 1 else ''} "
                f"served · {n['errors']} error{'s' if n['errors'] != 1 else ''}")

    def identity(self) -> str:
        if self.agent is None:
            return f"key {self.key_file}"
        return f"{self.agent.name} · {self.agent.host}:{self.agent.port} · fleet {self.agent.fleet_id}"

    def _poll(self) -> None:
        self._read_worker_logs()
        self._count_tokens()
        now = (self.state(), self.paused, len(self.shards()), tuple(self.counts.values()))
        if now != self._last:
            self._last = now
            self.changed.emit()

    def set_paused(self, paused: bool) -> None:
        """Pausing stops the node's workers (blocking), so it runs off the GUI thread."""
        agent = self.agent
        if agent is None or self.stopping:
            return

        def done(_result) -> None:
            self._log("paused: running workers stopped, no new work taken" if paused else "serving again")
            self.changed.emit()

        self.tasks.start(lambda report, cancel: agent.set_paused(paused), "pause" if paused else "resume",
                         succeeded=done, failed=lambda m: self.failed.emit(m))

    def toggle_pause(self) -> None:
        self.set_paused(not self.paused)

    def prune(self) -> None:
        """Removes the shards no running worker serves, off the GUI thread (the agent logs what)."""
        agent = self.agent
        if agent is None or self.stopping:
            return

        def done(result: dict) -> None:
            if not (result["dropped"] or result["unfinished"]):
                self._log("no unused shards to remove")
            self.changed.emit()

        self.tasks.start(lambda report, cancel: agent.prune(), "remove unused shards", succeeded=done,
                         failed=lambda m: self.failed.emit(m))

    def autostart_enabled(self) -> bool:
        return autostart.supported() is None and autostart.is_enabled()

    def set_autostart(self, on: bool) -> None:
        try:
            if on:
                where = autostart.enable()
                log.info("worker starts with the session: %s", where)
            else:
                autostart.disable()
        except (FleetError, OSError) as exc:
            self.failed.emit(str(exc))
        self.changed.emit()

    def quit(self) -> None:
        """Stops the agent cleanly off the GUI thread; ``stopped`` follows."""
        if self.stopping:
            return
        agent, self.stopping = self.agent, True
        self.timer.stop()
        self.changed.emit()
        if agent is None:
            self._stopped(None)
            return
        self.tasks.start(lambda report, cancel: agent.stop(), "stop agent", succeeded=self._stopped,
                         failed=lambda m: self._stopped(None))

    def _stopped(self, _result) -> None:
        self.agent = None
        self.changed.emit()
        self.stopped.emit()

    def use_key(self, path: Path) -> bool:
        """A new key file (for an agent that could not start without one)."""
        self.key_file = Path(path)
        return self.start()


class WorkerWindow(QWidget):
    """The worker's controls where no system tray exists."""

    def __init__(self, controller: WorkerController, parent: QWidget | None = None):
        super().__init__(parent)
        self.controller = controller
        self.setWindowTitle("fleetshard worker")
        self.setWindowIcon(theme.icon())
        self.banner = Banner()
        title = QLabel("This PC serves the fleet")
        font = title.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.25)
        title.setFont(font)
        explain = QLabel("The PC that runs the fleet's chat sends this PC a part of the model, and this PC runs "
                         "it. Pause to take this PC back for a while; Quit to leave the fleet.")
        explain.setObjectName("hint")
        explain.setWordWrap(True)
        self.identity = QLabel()
        self.status = QLabel()
        self.stage = QLabel()
        self.shards = QLabel()
        self.tally = QLabel()
        form = QFormLayout()
        for label, widget in (("Node", self.identity), ("Status", self.status), ("Serving", self.stage),
                              ("Shards held", self.shards), ("Activity", self.tally)):
            plain(widget).setWordWrap(True)  # the node's name, the coordinator's models, the agent's errors
            widget.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            form.addRow(label, widget)
        self.activity = QPlainTextEdit()
        self.activity.setReadOnly(True)
        self.activity.setMaximumBlockCount(500)
        self.activity.setPlaceholderText("What the agent does appears here: connections, shards received, parts "
                                         "started, errors.")
        activity_box = QGroupBox("Activity")
        QVBoxLayout(activity_box).addWidget(self.activity)
        self.pause_button = QPushButton("Pause serving")
        self.pause_button.clicked.connect(controller.toggle_pause)
        self.prune_button = QPushButton("Remove unused shards")
        self.prune_button.setToolTip("take back this PC's disk space: remove the shards it does not serve now")
        self.prune_button.clicked.connect(controller.prune)
        self.key_button = QPushButton("Choose key file…")
        self.key_button.clicked.connect(self._ask_key)
        self.autostart = QCheckBox("Start with the session")
        problem = autostart.supported()
        self.autostart.setEnabled(problem is None)
        self.autostart.setToolTip(problem or "start this worker when you log in")
        self.autostart.setChecked(controller.autostart_enabled())
        self.autostart.toggled.connect(controller.set_autostart)
        self.quit_button = QPushButton("Quit")
        self.quit_button.setToolTip("stop serving: workers stop, and the fleet sees this PC leave")
        self.quit_button.clicked.connect(controller.quit)
        buttons = QHBoxLayout()
        buttons.addWidget(self.autostart)
        buttons.addWidget(flow_bar(self.key_button, self.prune_button, self.pause_button, self.quit_button,
                                   align_right=True)[0], 1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(title)
        layout.addWidget(explain)
        layout.addLayout(form)
        layout.addWidget(activity_box, 1)
        layout.addLayout(buttons)
        controller.changed.connect(self.refresh)
        controller.logged.connect(self.log_line)
        controller.failed.connect(self.banner.error)
        controller.stopped.connect(self.close)
        self.refresh()

    def refresh(self) -> None:
        c = self.controller
        status, stage = c.state()
        self.identity.setText(c.identity())
        self.status.setText(status)
        self.stage.setText(stage or "—")
        shards = c.shards()
        self.shards.setText("; ".join(shard_text(s) for s in shards) or "none")
        self.tally.setText(c.tally())
        self.pause_button.setText("Resume serving" if c.paused else "Pause serving")
        self.pause_button.setEnabled(c.running)
        self.prune_button.setEnabled(c.running and bool(shards))
        self.key_button.setVisible(c.agent is None and not c.stopping)
        self.quit_button.setEnabled(not c.stopping)
        self.autostart.blockSignals(True)
        self.autostart.setChecked(c.autostart_enabled())
        self.autostart.blockSignals(False)

    def log_line(self, line: str) -> None:
        if line.startswith("control connection from") and line.endswith("closed the connection"):
            return  # a client hanging up after its requests: routine, not activity
        self.activity.appendPlainText(f"{time.strftime('%H:%M:%S')}  {unbidi(line)}")

    def _ask_key(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Fleet key file", str(self.controller.key_file))
        if path:
            self.choose_key(Path(path))

    def choose_key(self, path: Path) -> None:
        try:
            keystore.adopt(path)
        except (FleetError, OSError) as exc:
            self.banner.error(f"That key file cannot be used: {exc}")
            return
        if self.controller.use_key(path):
            self.banner.hide()

    def closeEvent(self, event) -> None:
        if self.controller.agent is not None:  # closing the window quits: stop cleanly first
            self.controller.quit()
            event.ignore()
            return
        super().closeEvent(event)


class WorkerTray(QObject):
    """The worker's tray icon and menu."""

    def __init__(self, controller: WorkerController, parent: QObject | None = None):
        super().__init__(parent)
        self.controller = controller
        self.menu = QMenu()
        self.status_action = QAction("", self.menu)
        self.status_action.setEnabled(False)
        self.stage_action = QAction("", self.menu)
        self.stage_action.setEnabled(False)
        self.tally_action = QAction("", self.menu)
        self.tally_action.setEnabled(False)
        self.pause_action = QAction("Pause serving", self.menu)
        self.pause_action.triggered.connect(controller.toggle_pause)
        self.prune_action = QAction("Remove unused shards", self.menu)
        self.prune_action.triggered.connect(controller.prune)
        self.autostart_action = QAction("Start with the session", self.menu, checkable=True)
        self.autostart_action.setEnabled(autostart.supported() is None)
        self.autostart_action.toggled.connect(controller.set_autostart)
        self.quit_action = QAction("Quit", self.menu)
        self.quit_action.triggered.connect(controller.quit)
        for action in (self.status_action, self.stage_action, self.tally_action):
            self.menu.addAction(action)
        self.menu.addSeparator()
        for action in (self.pause_action, self.prune_action, self.autostart_action):
            self.menu.addAction(action)
        self.menu.addSeparator()
        self.menu.addAction(self.quit_action)
        self.icon = QSystemTrayIcon(theme.icon())
        self.icon.setContextMenu(self.menu)
        controller.changed.connect(self.refresh)
        controller.failed.connect(lambda m: self.icon.showMessage("fleetshard worker", m,
                                                                  QSystemTrayIcon.MessageIcon.Warning))
        self.refresh()
        self.icon.show()

    def refresh(self) -> None:
        c = self.controller
        status, stage = c.state()
        self.status_action.setText(f"Status: {status}")
        self.stage_action.setText(f"Serving: {stage}" if stage else "")
        self.stage_action.setVisible(bool(stage))
        self.tally_action.setText(f"Activity: {c.tally()}")
        self.pause_action.setText("Resume serving" if c.paused else "Pause serving")
        self.pause_action.setEnabled(c.running)
        self.prune_action.setEnabled(c.running)
        self.quit_action.setEnabled(not c.stopping)
        self.autostart_action.blockSignals(True)
        self.autostart_action.setChecked(c.autostart_enabled())
        self.autostart_action.blockSignals(False)
        self.icon.setToolTip(plain_line(f"fleetshard worker: {status}" + (f"\n{stage}" if stage else "")))


def build_worker(key_file: Path, *, listen: str = DEFAULT_LISTEN, name: str | None = None, advertise: bool = True,
                 store: Path | None = None, tls: bool = False, poll_ms: int = 1000, tray: bool | None = None):
    """Starts the agent and its front end: the tray icon when a system tray exists (or ``tray``
    says so), else the window; ``tls``: the fleet speaks TLS.  Returns (controller, front end)."""
    controller = WorkerController(key_file, listen=listen, name=name, advertise=advertise, store=store, tls=tls,
                                  poll_ms=poll_ms)
    use_tray = QSystemTrayIcon.isSystemTrayAvailable() if tray is None else tray
    front = WorkerTray(controller) if use_tray else WorkerWindow(controller)
    controller.start()
    if not use_tray:
        front.show()
    return controller, front


def run_worker(args) -> int:
    """``fleetgui --worker``: the event loop of worker mode (the QApplication exists)."""
    app = QApplication.instance()
    settings = GuiSettings.load(default_store())
    theme.apply(settings.theme)
    key_file = Path(args.fleet_key_file).expanduser() if args.fleet_key_file else keystore.key_path(settings)
    keystore.materialise(key_file, default=not (args.fleet_key_file or settings.fleet_key_file))
    controller, front = build_worker(key_file, listen=args.listen, name=args.name, advertise=not args.no_mdns,
                                     tls=_tls_enabled())
    app.setQuitOnLastWindowClosed(isinstance(front, WorkerWindow))
    controller.stopped.connect(app.quit)
    app.aboutToQuit.connect(lambda: controller.agent and controller.agent.stop())
    on_signals(app, controller.quit)  # `kill` and Ctrl+C leave the fleet cleanly too
    return app.exec()


def _tls_enabled() -> bool:
    """Whether the saved settings turn TLS on (an unreadable settings file: the default)."""
    try:
        return Settings.load().tls
    except (OSError, ValueError, TypeError, FleetError):
        return Settings().tls
