"""The Fleet view: the fleet's machines, live.

Nodes arrive over discovery (``engine.fleet.unicast.Discovery``: mDNS, and the known nodes a join code
or a subnet scan added, dialled; its events relayed to the GUI thread by a queued signal, with how each
node is found now) and by address (kept in the engine settings' ``nodes``, the list ``fleet nodes add``
writes, so the app and the command line share it); "Found by" says which.  Every few seconds each
node's agent is asked for its status off the GUI thread: devices, memory, what it does (idle, serving
part k of n, receiving, profiling, paused, or unreachable) and the shards it holds.  While this app's
placement view deploys, a node whose part is still being exported here shows "preparing part k" (a
node does no exporting of its own: this PC, the coordinator, exports, then ships).
"Measure round trips" times this PC to each agent and each agent to the others.  The fleet key
is set here too (``fleetgui.keystore``).

This machine (the coordinator: stage 0 of every chain runs in the app) has a row of its own, and so
has every node agent this app started (``engine.fleet.local_agent.own_agents``): the local fleet's worker
agent and a demo fleet's nodes.  "Try a demo fleet" starts such demo nodes (``engine.fleet.demo``:
separate agent processes on this PC, simulated devices, each row marked "demo" and "simulated"), so
profiling, placing, deploying and losing a node can be tried on one PC; "Remove node" on a demo
node switches it off.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QApplication, QDialog, QDialogButtonBox, QFileDialog, QFormLayout,
                               QGroupBox, QHeaderView, QLabel, QLineEdit, QMenu, QMessageBox, QPushButton, QStyle,
                               QTableView, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from engine.config import FleetAccess, forget_nodes, known_nodes, remember_nodes
from engine.errors import FleetError
from engine.fleet.unicast import Discovery
from engine.fleet.node import KERNEL_PATHS, runs_slowly
from engine.fleet.shardstore import pruned_text, shard_text
from engine.hostcpu import INT8_NOTE
from engine.manifest import layer_span, part_name
from fleetgui import keystore
from fleetgui.discovery_status import DiscoveryStatus
from fleetgui.join_code import JoinCodeDialog
from fleetgui.running import Node, Running
from fleetgui.widgets import Banner, flow_bar, plain, plain_tip, splitter, unbidi
from fleetgui.workers import TaskRunner

COLUMNS = ("Name", "Address", "OS", "Devices", "Memory", "Status", "Shards", "Found by")
POLL_MS = 3000
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.\-]{0,251}[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]+\]?")
THIS_PC = "this PC"  # this PC's row: its role, shown in Found by, and its key
THIS_PC_STATE = "this PC: runs the chat and the first part of the model"
THIS_PC_DETAIL = "the coordinator: it runs stage 0 (the tokenizer and the embedding) of every chain"
LOCAL_FLEET = "local fleet"  # the role of the chat's local fleet agent (``engine.fleet.local_agent.start_local_agent``)
DEMO_NODES = 3  # how many "Try a demo fleet" starts
DEMO_NEXT = ("Demo fleet up. Next: in Placement, click Profile fleet, set how many people at once and click Deploy "
             "the best layout; then chat. Select a demo node here and click Remove node to switch it off: the chat's "
             "layers move to the others.")
NODE_MEANING = "A node is a computer, or a worker on this PC, that runs part of the model."
ADD_NODE_HELP = ("Add a PC that the fleet does not find by itself (another subnet, or a network that drops "
                 "multicast). On that PC, start the tray worker: install fleetshard and run `fleetgui --worker` "
                 "(or `fleetshard --worker` from the worker bundle) with this fleet's key. It listens on port 7390. "
                 "Without a desktop, `fleet agent` does the same from the command line.")
STATUS_COLOURS = {"unreachable": "#c0392b", "paused": "#b9770e", "serving": "#1e8449", "standby": "#1e8449",
                  "preparing": "#1f618d"}


def added_nodes() -> list[str]:
    """The nodes added by hand: the engine settings' known nodes, shared with ``fleet nodes add``."""
    try:
        return known_nodes(by_hand=True)
    except FleetError:
        return []


def address_problem(text: str, known: list[str] = ()) -> str | None:
    """What is wrong with a node address typed by hand, in words; None when it is a HOST:PORT."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not text:
        return "type the node agent's address, like 192.168.1.20:7390"
    if not sep or not host:
        return "give HOST:PORT, like 192.168.1.20:7390 (the agent listens on port 7390 by default)"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"the port must be a number from 1 to 65535, not {port!r}"
    if not _HOST.fullmatch(host):
        return f"{host!r} is not a host name or IP address"
    if text in known:
        return f"{text} is already in the list"
    return None


# --- the table of nodes -------------------------------------------------------------------------------

@dataclasses.dataclass
class NodeRow:
    key: str  # the node id once known, else "address:HOST:PORT"
    address: str = ""  # HOST:PORT of its agent's control API
    name: str = ""
    node_id: str = ""
    os: str = ""
    cpu: str = ""
    devices: list[str] = dataclasses.field(default_factory=list)
    memory_mb: int = 0
    available_mb: int = 0
    state: str = "waiting for status"
    workers: list[dict] = dataclasses.field(default_factory=list)
    shards: list[dict] = dataclasses.field(default_factory=list)
    mdns: bool = False  # its mDNS record is seen
    known: str = ""  # dialled as a known node: how its address became known ("join code", "subnet scan")
    added_as: str = ""  # the address it was added by (it may differ from the mDNS one it is polled at)
    error: str = ""  # why the last status request failed
    preparing: str = ""  # what this app is doing for the node ("exporting stage 2 (40%)")
    role: str = ""  # THIS_PC, or an own agent's role ("local fleet", "demo"); "" for the fleet's nodes
    simulated: bool = False  # a demo node: its devices are simulated
    int8_dot: str = ""  # its CPU's int8 dot-product instructions (engine.hostcpu)
    kernels: str = ""  # which kernels run its matrices (engine.fleet.node.KERNEL_PATHS); "": not said
    standbys: frozenset = frozenset()  # ids of the running deployment's hot standby workers (any node's)

    @property
    def added(self) -> bool:
        return bool(self.added_as)

    @property
    def status(self) -> str:
        if self.error:
            return "unreachable"
        if self.preparing:
            return self.preparing
        if self.state.startswith("serving") and self.running_workers():
            return "; ".join(self.serving())
        return self.state

    def serving(self) -> list[str]:
        """What its running workers do, in words: "serving part 2 of 3 (layers 1-2)", "standby for part 3
        (layer 3)" (a hot standby, ready to take that part over)."""
        def parts(workers: list[dict], counted: bool) -> str:
            return ", ".join(part_name(w.get("stage"), w.get("stages") if counted else None)
                             + (f" ({layer_span(*w['layers'])})" if w.get("layers") else "") for w in workers)
        workers = self.running_workers()
        active = [w for w in workers if w.get("id") not in self.standbys]
        ready = [w for w in workers if w.get("id") in self.standbys]
        return ([f"serving {parts(active, True)}"] if active else []) + \
            ([f"standby for {parts(ready, not active)}"] if ready else [])

    @property
    def found_by(self) -> str:
        """Each way the node is found, as it is now: its role (this PC, local fleet, demo), mDNS,
        the join code or subnet scan that made its address known, an address added by hand."""
        ways = ((self.role, bool(self.role)), ("mDNS", self.mdns), (self.known, bool(self.known)),
                ("by hand", self.added))
        return " + ".join(name for name, on in ways if on)

    @property
    def label(self) -> str:
        """The name as shown: a demo node's says it is simulated."""
        return (self.name or "(asking…)") + (" (simulated)" if self.simulated else "")

    def running_workers(self) -> list[dict]:
        return [w for w in self.workers if str(w.get("state", "running")) == "running"]

    def unused_shards(self) -> list[dict]:
        """The shards no running worker of the node serves."""
        served = {w.get("hash") for w in self.running_workers()}
        return [s for s in self.shards if s.get("hash") not in served]

    def shards_text(self) -> str:
        """The node's shards by model, one entry each: "qwen2: layers 0-1, layers 2-3 (int4), layers 2-3
        (f32)"; the weights are named where two shards hold the same layers (the tooltip has each one)."""
        if not self.shards:
            return "none"
        by_model: dict[str, list[dict]] = {}
        for s in self.shards:
            by_model.setdefault(s.get("model", "?"), []).append(s)
        parts = []
        for model, shards in by_model.items():
            same = collections.Counter(tuple(s["layers"]) for s in shards)
            parts.append(f"{model}: " + ", ".join(
                layer_span(*s["layers"]) + (f" ({s.get('weights')})" if same[tuple(s["layers"])] > 1 else "")
                for s in sorted(shards, key=lambda s: (tuple(s["layers"]), str(s.get("weights"))))))
        return "; ".join(parts)

    def memory_text(self) -> str:
        if not self.memory_mb:
            return ""
        return f"{self.available_mb / 1024:.1f} of {self.memory_mb / 1024:.1f} GB free"

    def take_node(self, node: dict) -> None:
        """Facts from a status reply's or an mDNS record's node fields."""
        self.name = str(node.get("name") or self.name)
        self.node_id = str(node.get("node_id") or self.node_id)
        self.os = str(node.get("os") or self.os)
        self.cpu = str(node.get("cpu") or self.cpu)
        devices = [d.get("name") for d in node.get("devices") or [] if isinstance(d, dict) and d.get("name")]
        self.devices = devices or self.devices
        self.memory_mb = int(node.get("memory_mb") or self.memory_mb)
        self.available_mb = int(node.get("available_mb") or self.available_mb)
        self.simulated = bool(node.get("simulated", self.simulated))
        self.int8_dot = str(node.get("int8_dot") or self.int8_dot)
        self.kernels = str(node.get("kernels") or self.kernels)

    @property
    def slow_cpu(self) -> bool:
        return runs_slowly(self.int8_dot, self.kernels)


def _tooltip(row: NodeRow, column: str) -> str:
    """A cell's tooltip, as text: why the node is unreachable, its shards one by one, its CPU."""
    if column == "Status" and row.error:
        return row.error
    if column == "Status" and row.role == THIS_PC:
        return THIS_PC_DETAIL
    if column == "Shards" and row.shards:
        return "\n".join(shard_text(s) for s in row.shards)
    if column in ("Name", "Devices") and row.node_id:
        lines = [row.cpu, f"node id {row.node_id}"]
        if row.kernels in KERNEL_PATHS:
            lines.append(f"matrices: {KERNEL_PATHS[row.kernels]}")
        if row.slow_cpu:
            lines.append(INT8_NOTE)
        return "\n".join(lines)
    return ""


class NodesModel(QAbstractTableModel):
    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.rows: list[NodeRow] = []
        self.known_by: dict[str, str] = {}  # known node address -> how it became known, this session
        # beside the devices of a CPU that runs OpenVINO slowly (its tooltip says why)
        self.slow_cpu_icon = QApplication.style().standardIcon(QStyle.StandardPixmap.SP_MessageBoxWarning)

    # --- Qt's side -----------------------------------------------------------------------------------

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return COLUMNS[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        column = COLUMNS[index.column()]
        if role == Qt.ItemDataRole.DisplayRole:  # a node's name, OS, devices and shards are its own words
            return unbidi({"Name": row.label, "Address": row.address, "OS": row.os,
                    "Devices": ", ".join(row.devices), "Memory": row.memory_text(), "Status": row.status,
                    "Shards": row.shards_text() if not row.error and row.role != THIS_PC else "",
                    "Found by": row.found_by}[column])
        if role == Qt.ItemDataRole.ToolTipRole:
            return plain_tip(_tooltip(row, column)) or None
        if role == Qt.ItemDataRole.DecorationRole and column == "Devices" and row.slow_cpu:
            return self.slow_cpu_icon
        if role == Qt.ItemDataRole.ForegroundRole and column == "Status":
            word = row.status.split(" ", 1)[0]
            return QColor(STATUS_COLOURS[word]) if word in STATUS_COLOURS else None
        if role == Qt.ItemDataRole.UserRole:
            return row
        return None

    # --- updates -------------------------------------------------------------------------------------

    def row(self, name: str) -> NodeRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def addresses(self) -> list[str]:
        return [r.address for r in self.rows if r.address]

    def node_rows(self) -> list[NodeRow]:
        """Every row but this machine's own."""
        return [r for r in self.rows if r.role != THIS_PC]

    def this_machine(self, node: dict | None = None) -> NodeRow:
        """This machine's row (made first, at the top), with ``node``'s facts (``local_node_info``)."""
        row = next((r for r in self.rows if r.role == THIS_PC), None)
        if row is None:
            row = NodeRow(key=THIS_PC, name=THIS_PC, role=THIS_PC,
                          state=THIS_PC_STATE)
            self.beginInsertRows(QModelIndex(), 0, 0)
            self.rows.insert(0, row)
            self.endInsertRows()
        if node:
            row.take_node({**node, "name": f"this PC ({node.get('name')})"})
            self._changed(row)
        return row

    def own_agents(self, agents: list) -> None:
        """The node agents this app runs (``engine.fleet.local_agent.own_agents``): a row each while it runs."""
        live = {a.address: a for a in agents}
        for row in [r for r in self.rows if r.role not in ("", THIS_PC) and r.address not in live]:
            self._drop(row)
        for agent in agents:
            row = next((r for r in self.rows if r.address == agent.address), None)
            if row is None:
                self._append(NodeRow(key=f"own:{agent.address}", address=agent.address, name=agent.name,
                                     role=agent.role))
            elif row.role != agent.role:
                row.role = agent.role
                self._changed(row)

    def mark_standbys(self, workers: frozenset) -> None:
        """Which running workers are hot standbys (``Deployment.standbys``): their rows say so."""
        for row in self.rows:
            if row.standbys != workers:
                row.standbys = workers
                self._changed(row)

    def reachable(self) -> list[NodeRow]:
        return [r for r in self.rows if r.address and not r.error and r.node_id]

    def _changed(self, row: NodeRow) -> None:
        i = self.rows.index(row)
        self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))

    def _append(self, row: NodeRow) -> None:
        self.beginInsertRows(QModelIndex(), len(self.rows), len(self.rows))
        self.rows.append(row)
        self.endInsertRows()

    def _drop(self, row: NodeRow) -> None:
        i = self.rows.index(row)
        self.beginRemoveRows(QModelIndex(), i, i)
        del self.rows[i]
        self.endRemoveRows()

    def discovered(self, kind: str, info, sources: tuple[str, ...] = ("mdns",)) -> None:
        """A discovery event (``engine.fleet.unicast.Discovery``); ``sources``: how the node is found now,
        "mdns" (its record) and "known" (its address dialled, known from a join code or a scan)."""
        addresses = [f"{a}:{info.port}" for a in info.addresses]
        row = next((r for r in self.rows if r.node_id == info.node_id), None) or \
            next((r for r in self.rows if r.address in addresses and r.address), None)
        if kind == "removed":
            if row is None:
                return
            row.mdns, row.known = False, ""
            if row.role == THIS_PC:  # this machine's own agent stopped: the machine stays
                row.address = row.added_as
                self._changed(row)
            elif row.added or row.role:
                self._changed(row)
            else:
                self._drop(row)
            return
        if row is None:
            row = NodeRow(key=info.node_id)
            self._append(row)
        row.mdns = "mdns" in sources
        row.known = self.known_as(addresses) if "known" in sources else ""
        row.take_node(dataclasses.asdict(info))
        if not row.added and addresses:
            row.address = addresses[0]
        if not row.error:
            row.state = info.status
        self._changed(row)

    def learned(self, how: str, addresses: list[str]) -> None:
        """``addresses`` became known nodes by ``how`` ("join code", "subnet scan"): rows found at them say so."""
        self.known_by.update(dict.fromkeys(addresses, how))
        for row in [r for r in self.rows if r.known and r.address in addresses and r.known != how]:
            row.known = how
            self._changed(row)

    def known_as(self, addresses: list[str]) -> str:
        """How a known node at one of ``addresses`` became known; a node known from before this app
        started: by one of the two."""
        return next((self.known_by[a] for a in addresses if a in self.known_by), "join code or scan")

    def add_address(self, address: str) -> None:
        row = next((r for r in self.rows if r.address == address), None)
        if row is None:
            self._append(NodeRow(key=f"address:{address}", address=address, added_as=address))
        else:
            row.added_as = address
            self._changed(row)

    def remove_address(self, address: str) -> None:
        for row in [r for r in self.rows if r.added_as == address]:
            row.added_as = ""
            if row.mdns:
                self._changed(row)
            else:
                self._drop(row)

    def prepare(self, address: str, text: str) -> None:
        """What this app is doing for the node at ``address`` ("" when it is done)."""
        for row in [r for r in self.rows if r.address == address and r.preparing != text]:
            row.preparing = text
            self._changed(row)

    def statuses(self, results: dict[str, dict]) -> None:
        """Replies of ``EngineBackend.node_status``: address -> status, or {"error": reason}."""
        for address, status in results.items():
            for row in [r for r in self.rows if r.address == address]:
                if "error" in status:
                    row.error = status["error"]
                    self._changed(row)
                    continue
                node = status.get("node", {})
                twin = next((r for r in self.rows if r is not row and node.get("node_id")
                             and r.node_id == node.get("node_id")), None)
                if twin is not None and row.added and not row.mdns:  # the same node, found both ways
                    twin.added_as = row.added_as
                    twin.address = twin.address or row.address  # this machine's row, polled from now on
                    self._drop(row)
                    row = twin
                row.error = ""
                row.take_node(node)
                row.state = str(status.get("state", ""))
                row.workers = list(status.get("workers", []))
                row.shards = list(status.get("shards", []))
                self._changed(row)


# --- dialogs and the round-trip matrix ------------------------------------------------------------------

class AddNodeDialog(QDialog):
    """Asks for a node agent's HOST:PORT; OK stays disabled until the text is one."""

    def __init__(self, known: list[str], parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Add a node by address")
        self.known = list(known)
        self.address = QLineEdit()
        self.address.setPlaceholderText("HOST:PORT, like 192.168.1.20:7390")
        # wide enough for the whole placeholder in the dialog's font
        self.address.setMinimumWidth(self.address.fontMetrics().horizontalAdvance(self.address.placeholderText()) +
                                     self.address.fontMetrics().averageCharWidth() * 4)
        self.hint = plain(QLabel())  # it quotes the text typed
        self.hint.setObjectName("hint")
        self.hint.setWordWrap(True)
        explain = QLabel(ADD_NODE_HELP)
        explain.setWordWrap(True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        form = QFormLayout()
        form.addRow("Address", self.address)
        layout = QVBoxLayout(self)
        layout.addWidget(explain)
        layout.addLayout(form)
        layout.addWidget(self.hint)
        layout.addWidget(self.buttons)
        self.address.textChanged.connect(self._check)
        self._check()

    def problem(self) -> str | None:
        return address_problem(self.address.text(), self.known)

    def _check(self) -> None:
        problem = self.problem()
        self.hint.setText(problem or "")
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(problem is None)

    def accept(self) -> None:
        if self.problem() is None:
            super().accept()

    def result_address(self) -> str:
        return self.address.text().strip()


class RoundTripTable(QTableWidget):
    """Measured round trips in ms, from the row's machine to the column's."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(0, 0, parent)
        self.labels: list[tuple[str, str]] = []  # (key, name) of each row and column shown
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)

    def show_matrix(self, labels: dict[str, str], measured: dict[tuple[str, str], float | None]) -> None:
        self.labels = list(labels.items())
        keys = list(labels)
        self.setRowCount(len(keys))
        self.setColumnCount(len(keys))
        names = [labels[k] for k in keys]
        self.setHorizontalHeaderLabels(names)
        self.setVerticalHeaderLabels(names)
        for i, a in enumerate(keys):
            for j, b in enumerate(keys):
                if a == b:
                    text = "—"
                elif (a, b) in measured or (b, a) in measured:
                    value = measured.get((a, b), measured.get((b, a)))
                    text = "unreachable" if value is None else f"{value:.2f}"
                else:
                    text = ""
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                self.setItem(i, j, item)

    def value(self, row_label: str, column_label: str) -> str:
        labels = [self.verticalHeaderItem(i).text() for i in range(self.rowCount())]
        return self.item(labels.index(row_label), labels.index(column_label)).text()


class _Discovery(QObject):
    """A fleet's discovery (``engine.fleet.unicast.Discovery``: mDNS and the known nodes) whose events reach
    the GUI thread (queued signal).  A record or a known address reaches the view only once its agent
    proved the key and its node id, so a record cannot move a node the view knows to another address."""

    event = Signal(str, object, tuple)  # kind, NodeInfo, how it is found now ("mdns", "known")

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.browser = None

    def start(self, access: FleetAccess) -> None:
        self.stop()
        discovery = Discovery(access, on_event=lambda kind, info: self.event.emit(
            kind, info, tuple(discovery.sources().get(info.node_id, ()))))
        self.browser = discovery.start()

    def stop(self) -> None:
        browser, self.browser = self.browser, None
        if browser is not None:
            browser.close()


# --- the view ---------------------------------------------------------------------------------------------

class FleetView(QWidget):
    key_changed = Signal(str)  # the fleet key file the app now uses ("": the default one)

    def __init__(self, settings, backend, tasks: TaskRunner, *, poll_ms: int = POLL_MS, discover: bool = True,
                 running: Running | None = None, parent: QWidget | None = None):
        """``running``: the app's running state; this view gives it the nodes and shows its API line."""
        super().__init__(parent)
        self.settings = settings
        self.running = running or Running(self)
        self.backend = backend
        self.tasks = tasks
        self.discover = discover
        self.key: keystore.KeyState | None = None
        self._poll = None
        self._rtt = None
        self.round_trips: dict | None = None  # the last measurement (``EngineBackend.round_trips``)
        self.banner = Banner()
        self.model = NodesModel(self)
        self.discovery = _Discovery(self)
        self.discovery.event.connect(self.model.discovered)

        self.key_label = plain(QLabel())
        self.key_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.key_label.setWordWrap(True)
        self.key_note = plain(QLabel())  # the key file's problem, in words
        self.key_note.setObjectName("hint")
        self.key_note.setWordWrap(True)
        create = QPushButton("New key…")
        create.setToolTip("make a new fleet key; copy the file to every PC of the fleet")
        create.clicked.connect(self._ask_create_key)
        choose = QPushButton("Choose key file…")
        choose.clicked.connect(self._ask_choose_key)
        key_box = QGroupBox("Fleet key")
        key_row = QVBoxLayout(key_box)  # the path above its buttons: a long path wraps, the buttons stay on screen
        key_row.addWidget(self.key_label)
        key_row.addWidget(self.key_note)
        key_row.addWidget(flow_bar(create, choose, align_right=True)[0])

        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        self.table.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.table.customContextMenuRequested.connect(self._show_row_menu)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        header.setStretchLastSection(False)
        for i, name in enumerate(COLUMNS):
            if name in ("Status", "Shards"):
                header.setSectionResizeMode(i, QHeaderView.ResizeMode.Stretch)
            else:
                header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        self.add_button = QPushButton("Add node…")
        self.add_button.clicked.connect(self._ask_add_node)
        self.join_button = QPushButton("Join code…")  # for networks that drop multicast (fleetgui.join_code)
        self.join_button.clicked.connect(self._ask_join_code)
        self.discovery_status = DiscoveryStatus()  # why no node is found
        self.remove_button = QPushButton("Remove node")
        self.remove_button.setToolTip("forget a node added by address, or switch a demo node off")
        self.remove_button.clicked.connect(self.remove_selected)
        self.prune_button = QPushButton("Remove unused shards…")
        self.prune_button.setToolTip("give the selected node its disk space back: remove the shards its workers "
                                     "do not serve")
        self.prune_button.clicked.connect(self._ask_prune)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.rtt_button = QPushButton("Measure round trips")
        self.rtt_button.setObjectName("primary")
        self.rtt_button.clicked.connect(self.measure_round_trips)
        self.summary = QLabel()
        self.summary.setObjectName("hint")
        self.summary.setWordWrap(True)
        # the buttons wrap onto a second line in a narrow window instead of widening it
        tools_bar, tools = flow_bar(self.add_button, self.join_button, self.remove_button, self.prune_button,
                                    self.refresh_button, self.rtt_button)
        self.demo = None  # the demo fleet this view started (``engine.fleet.demo.DemoFleet``)
        self._demo_task = None
        self.demo_button = QPushButton("Try a demo fleet")
        self.demo_button.setToolTip(f"no second PC at hand? start {DEMO_NODES} demo nodes on this one: separate node "
                                    "agents with simulated devices, to profile, place layers on, deploy to and chat")
        self.demo_button.clicked.connect(lambda: self.stop_demo() if self.demo else self.start_demo())
        tools.addWidget(self.demo_button)
        self.demo_note = plain(QLabel())  # the demo nodes' names
        self.demo_note.setObjectName("demoNote")
        self.demo_note.setWordWrap(True)
        self.demo_note.setStyleSheet("font-weight: bold;")
        self.demo_note.hide()

        self.rtt_table = RoundTripTable()
        self.rtt_note = QLabel("Round trips between the nodes' control ports, in ms (median of 5). "
                               "Click Measure round trips.")
        self.rtt_note.setObjectName("hint")
        self.rtt_note.setWordWrap(True)
        rtt_box = QGroupBox("Round trips")
        rtt_layout = QVBoxLayout(rtt_box)
        rtt_layout.addWidget(self.rtt_note)
        rtt_layout.addWidget(self.rtt_table, 1)

        nodes = QWidget()
        nodes_layout = QVBoxLayout(nodes)
        nodes_layout.setContentsMargins(0, 0, 0, 0)
        nodes_layout.addWidget(tools_bar)
        nodes_layout.addWidget(self.summary)
        nodes_layout.addWidget(self.discovery_status)
        nodes_layout.addWidget(self.demo_note)
        nodes_layout.addWidget(self.table, 1)
        split = splitter(Qt.Orientation.Vertical, (nodes, 3), (rtt_box, 1))
        # the OpenAI-compatible API's status line (``fleetgui.api``): where tools reach the fleet's model
        self.api_label = plain(QLabel(self.running.api_text))
        self.api_label.setObjectName("hint")
        self.api_label.setWordWrap(True)
        self.api_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addWidget(self.api_label)
        layout.addWidget(key_box)
        layout.addWidget(split, 1)

        self.model.this_machine()
        self.tasks.start(lambda report, cancel: backend.this_machine(), "this PC",
                         succeeded=self.model.this_machine)
        for address in added_nodes():
            self.model.add_address(address)
        self.model.rowsInserted.connect(self._summarise)
        self.model.rowsRemoved.connect(self._summarise)
        self.model.dataChanged.connect(self._summarise)
        self.running.changed.connect(lambda: self.api_label.setText(self.running.api_text))
        self.running.changed.connect(self._follow_standbys)
        self.timer = QTimer(self)
        self.timer.setInterval(poll_ms)
        self.timer.timeout.connect(self.refresh)
        self.reload_key()
        self.timer.start()
        self.refresh()

    # --- the key -------------------------------------------------------------------------------------

    def reload_key(self) -> None:
        """Reads the key in force and (re)starts discovery for its fleet."""
        before = self.key.fleet_id if self.key else None
        self.key = keystore.state(self.settings)
        if self.key.usable:
            self.key_label.setText(f"{self.key.path}  ·  fleet {self.key.fleet_id}")
            self.key_note.setText(_sentence(self.key.storage()) + ". Copy the file to every PC of the fleet.")
        else:
            missing = not self.key.path.exists()
            self.key_label.setText(f"No fleet key yet at {self.key.path}" if missing else
                                   f"The fleet key at {self.key.path} cannot be used")
            self.key_note.setText(("" if missing else _sentence(self.key.problem) + ". ") +
                                  "Make a new key on one PC and copy the file to the others, or choose the "
                                  "file another PC of the fleet uses.")
        if self.key.fleet_id != before or (self.discover and self.discovery.browser is None and self.key.usable):
            self._start_discovery()
        self._summarise()

    def _start_discovery(self) -> None:
        for row in [r for r in self.model.rows if r.mdns or r.known]:  # another fleet: its nodes go
            self.model.discovered("removed", _Gone(row.node_id))
        self.discovery.stop()
        if not (self.discover and self.key and self.key.usable):
            return
        try:
            self.discovery.start(keystore.access(self.settings))
        except FleetError as exc:
            self.banner.info(f"Nodes cannot be discovered on this network ({exc}). Add them by address.")

    def create_key(self, path) -> None:
        try:
            keystore.create(Path(path))
        except (FleetError, OSError) as exc:
            self.banner.error(f"Could not create the fleet key: {exc}")
            return
        self._use_key(str(path))
        self.banner.info(f"New fleet key in {path}. Copy this file to every PC of the fleet.")

    def choose_key(self, path) -> None:
        try:
            _, notice = keystore.adopt(Path(path))
        except (FleetError, OSError) as exc:
            self.banner.error(f"That key file cannot be used: {exc}")
            return
        self._use_key(str(path))
        if notice:
            self.banner.info(notice)

    def _use_key(self, path: str) -> None:
        default = keystore.key_path(dataclasses.replace(self.settings, fleet_key_file=""))
        path = "" if Path(path).expanduser() == default else path  # the default stays "the default"
        self.settings = dataclasses.replace(self.settings, fleet_key_file=path)
        self.key_changed.emit(path)
        self.reload_key()
        self.refresh()

    def _ask_create_key(self) -> None:
        path = keystore.key_path(self.settings)
        if path.exists():
            chosen, _ = QFileDialog.getSaveFileName(self, "New fleet key", str(path.with_name("fleet-new.key")))
            if not chosen:
                return
            path = chosen
        self.create_key(path)

    def _ask_choose_key(self) -> None:
        chosen, _ = QFileDialog.getOpenFileName(self, "Fleet key file", str(keystore.key_path(self.settings)))
        if chosen:
            self.choose_key(chosen)

    # --- nodes ---------------------------------------------------------------------------------------

    def add_node(self, address: str) -> str | None:
        """Adds a node by address (kept in the engine settings); returns the problem, if any."""
        address = address.strip()
        problem = address_problem(address, added_nodes())
        if problem:
            self.banner.error(problem)
            return problem
        remember_nodes([address], by_hand=True)
        self.model.add_address(address)
        self.refresh()
        return None

    def remove_node(self, address: str) -> None:
        self.forget([address])

    def remove_selected(self) -> None:
        row = self._selected()
        if row is None:
            return
        if row.role == "demo":
            self.stop_demo_node(row.name)
            return
        if row.role:
            self.banner.info(f"{row.name} is {'this PC' if row.role == THIS_PC else 'run by this app'}; "
                             "it is not removed from the list.")
            return
        if not row.added:
            self.banner.info(f"{row.name} was found over mDNS; it leaves the list when its agent stops.")
            return
        self.remove_node(row.added_as)

    def known_addresses(self, row: NodeRow) -> list[str]:
        """The saved known nodes that reach the PC of ``row``: the address it was added by, the one it is
        polled at, and those where the known nodes' dialler last found its node id."""
        reaches = self.discovery.browser.dialer.reaches() if self.discovery.browser else []
        mine = {row.added_as, row.address} | {r.address for r in reaches if row.node_id and r.node_id == row.node_id}
        try:
            return [a for a in known_nodes() if a in mine]
        except FleetError:
            return []

    def row_menu(self, row: NodeRow) -> QMenu:
        """The menu a right click on a node's row opens: "Forget this PC…" for a PC known by address (added
        by hand, from a join code or a scan)."""
        menu = QMenu(self)
        forget = menu.addAction("Forget this PC…")
        forget.setEnabled(not row.role and bool(self.known_addresses(row)))
        forget.setToolTip("the fleet stops dialling it; a PC that mDNS finds stays while its agent runs")
        forget.triggered.connect(lambda: self._ask_forget(row))
        return menu

    def _show_row_menu(self, pos) -> None:
        index = self.table.indexAt(pos)
        if index.isValid():
            menu = self.row_menu(self.model.rows[index.row()])
            menu.aboutToHide.connect(menu.deleteLater)
            menu.popup(self.table.viewport().mapToGlobal(pos))

    def _ask_forget(self, row: NodeRow) -> QMessageBox | None:
        """Asks before forgetting the PC of ``row`` (``forget``); returns the open question."""
        addresses = self.known_addresses(row)
        if not addresses:
            self.banner.info(f"{row.name or row.address} is not known by address; nothing to forget.")
            return None
        name = row.name or row.address
        box = plain(QMessageBox(QMessageBox.Icon.Question, "Forget this PC",
                                f"Forget {name} ({', '.join(addresses)})? The fleet stops dialling it; a join code "
                                "or Add node brings it back. A PC that mDNS finds stays in the list while its "
                                "agent runs.", QMessageBox.StandardButton.Ok | QMessageBox.StandardButton.Cancel,
                                self))
        box.button(QMessageBox.StandardButton.Ok).setText("Forget")
        box.accepted.connect(lambda: self.forget(addresses))
        box.finished.connect(box.deleteLater)
        box.open()
        return box

    def forget(self, addresses: list[str]) -> None:
        """Removes known nodes from the saved settings; their rows leave the list (one the known nodes'
        dialler found, at its next round, dialled now)."""
        forget_nodes(addresses)
        for address in addresses:
            self.model.remove_address(address)
        if self.discovery.browser:
            self.discovery.browser.dialer.poke()

    def _selected(self) -> NodeRow | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self.model.rows[rows[0].row()] if rows else None

    def _ask_prune(self) -> QMessageBox | None:
        """Asks before removing the selected node's unused shards; returns the open question."""
        row = self._selected()
        if row is None:
            self.banner.info("Select a node first.")
            return None
        name, unused = row.name or row.address, row.unused_shards()
        if row.error or not row.node_id:
            self.banner.info(f"{name} does not answer; its shards can be removed once it does.")
            return None
        if not unused:
            self.banner.info(f"{name} holds no shards that its workers do not serve.")
            return None
        size = sum(s.get("bytes", 0) for s in unused) / 2**20
        box = plain(QMessageBox(QMessageBox.Icon.Question, "Remove unused shards",
                                f"Remove {len(unused)} shard(s), {size:.1f} MB, from {name}? The shards its workers "
                                "serve are kept; a later deployment sends what it needs again. Transfers left "
                                "unfinished for 10 minutes go too.",
                                QMessageBox.StandardButton.Ok | QMessageBox.StandardButton.Cancel, self))
        box.button(QMessageBox.StandardButton.Ok).setText("Remove")
        box.accepted.connect(lambda: self.prune(row.address, name))
        box.finished.connect(box.deleteLater)
        box.open()
        return box

    def prune(self, address: str, name: str) -> None:
        """Removes the node's unused shards, off the GUI thread, then says what it freed."""
        settings, backend = self.settings, self.backend
        self.prune_button.setEnabled(False)

        def done(result: dict) -> None:
            self.prune_button.setEnabled(True)
            self.banner.info(f"Removed {pruned_text(len(result['dropped']), result['unfinished'])}, "
                             f"{result['bytes'] / 2**20:.1f} MB, from {name}.")
            self.refresh()

        def failed(message: str) -> None:
            self.prune_button.setEnabled(True)
            self.banner.error(f"Removing the shards of {name} failed: {message}")

        self.tasks.start(lambda report, cancel: backend.prune(address, settings), "remove unused shards",
                         succeeded=done, failed=failed)

    def _ask_add_node(self) -> AddNodeDialog:
        dialog = AddNodeDialog(added_nodes(), self)
        dialog.accepted.connect(lambda: self.add_node(dialog.result_address()))
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        return dialog

    def _ask_join_code(self) -> JoinCodeDialog:
        dialog = JoinCodeDialog(lambda: keystore.access(self.settings), self.tasks, parent=self)
        dialog.learned.connect(self.model.learned)
        dialog.known_changed.connect(lambda: self.discovery.browser and self.discovery.browser.dialer.poke())
        dialog.finished.connect(dialog.deleteLater)
        dialog.open()
        return dialog

    def agent_addresses(self) -> list[str]:
        """The agents that answered their last status request (what a survey can profile), but the
        chat's local fleet agent: it ends with that chat, which a deployment replaces."""
        return [r.address for r in self.model.reachable() if r.role != LOCAL_FLEET]

    # --- polling and round trips ---------------------------------------------------------------------

    @property
    def polling(self) -> bool:
        return self._poll is not None

    def refresh(self) -> None:
        """Asks every node's agent for its status, off the GUI thread (one request round at a time)."""
        self.model.own_agents(self.backend.own_agents())
        if not self.model.node_rows() and self.key and self.key.usable:
            self.discovery_status.check(self.discovery.browser, self.tasks)
        addresses = self.model.addresses()
        if self._poll is not None or not addresses or not (self.key and self.key.usable):
            return
        settings, backend = self.settings, self.backend
        self._poll = self.tasks.start(lambda report, cancel: backend.node_status(addresses, settings),
                                      "node status", succeeded=self._polled, failed=self._poll_failed)

    def _polled(self, results: dict) -> None:
        self._poll = None
        self.model.statuses(results)

    def _poll_failed(self, message: str) -> None:
        self._poll = None
        self.banner.error(f"Asking the nodes for their status failed: {message}")

    def live_nodes(self) -> dict[str, str]:
        """The listed nodes that answer, by address: their names (the chat's local worker too)."""
        return {r.address: r.name or r.address for r in self.model.reachable()}

    def measure_round_trips(self) -> None:
        addresses = list(self.live_nodes())
        if self._rtt is not None:
            return
        if not addresses:
            self.rtt_note.setText("No node answers yet: round trips need at least one reachable agent.")
            return
        settings, backend = self.settings, self.backend
        self.rtt_button.setEnabled(False)
        self.rtt_note.setText(f"Measuring round trips between {len(addresses) + 1} nodes…")
        self._rtt = self.tasks.start(lambda report, cancel: backend.round_trips(addresses, settings), "round trips",
                                     succeeded=self._measured, failed=self._rtt_failed)

    def _measured(self, measured: dict) -> None:
        self._rtt = None
        self.rtt_button.setEnabled(True)
        self.round_trips = measured
        self._follow_nodes()
        self.rtt_note.setText("Round trips between the nodes' control ports, in ms (median of 5): from the row's "
                              "PC to the column's.")

    def _rtt_failed(self, message: str) -> None:
        self._rtt = None
        self.rtt_button.setEnabled(True)
        self.rtt_note.setText("Round trips could not be measured.")
        self.banner.error(f"Measuring round trips failed: {message}")

    def _follow_nodes(self) -> None:
        """The round-trip matrix lists the nodes that answer now: one that stops leaves it, one that
        joins has empty cells until the next measurement."""
        if self.round_trips is None:
            return
        labels = {"local": THIS_PC, **self.live_nodes()}
        if list(labels.items()) != self.rtt_table.labels:
            self.rtt_table.show_matrix(labels, self.round_trips)

    def nodes(self) -> list[Node]:
        """Every row as the running state holds it: name, address, whether it answers, what it serves."""
        return [Node(r.label, r.address, r.role == THIS_PC or (not r.error and bool(r.node_id)),
                     tuple(r.serving()))
                for r in self.model.rows]

    def _follow_standbys(self) -> None:
        deployment = self.running.chat.deployment or self.running.deployment
        self.model.mark_standbys(frozenset(s["worker"] for s in deployment.standbys) if deployment else frozenset())

    def _summarise(self, *_) -> None:
        """The counts above the table, of its rows: this machine and every other node listed."""
        self.running.set_nodes(self.nodes())
        self._follow_nodes()
        if not (self.key and self.key.usable):
            text = "Set the fleet key to find this fleet's nodes."
        elif not self.model.node_rows():
            text = ("Looking for other PCs… Start the tray worker (`fleetgui --worker`) on each of them, add them "
                    "by address, or, with no second PC at hand, try a demo fleet. " + NODE_MEANING)
        else:
            self.discovery_status.clear()
            text = f"{self.running.nodes_text()}. {NODE_MEANING}"
        self.summary.setText(text)

    # --- settings and shutdown -----------------------------------------------------------------------

    def apply_settings(self, settings) -> None:
        changed = settings.fleet_key_file != self.settings.fleet_key_file
        self.settings = settings
        if changed:
            self.reload_key()

    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self.key is not None and not self.key.usable:  # the chat may have made the default key meanwhile
            self.reload_key()

    def shutdown(self) -> None:
        self.timer.stop()
        self.discovery.stop()
        demo, self.demo = self.demo, None
        if demo is not None:
            demo.close()

    # --- the demo fleet ------------------------------------------------------------------------------

    def start_demo(self, count: int = DEMO_NODES) -> None:
        """Starts ``count`` demo nodes on this PC off the GUI thread (the default fleet key is made if
        there is none); their rows appear as they answer."""
        if self.demo is not None or self._demo_task is not None:
            return
        settings, backend = self.settings, self.backend
        self.demo_button.setEnabled(False)
        self.banner.info(f"Starting a demo fleet of {count} nodes on this PC…")

        def started(fleet) -> None:
            self._demo_task = None
            self.demo = fleet
            self.demo_button.setEnabled(True)
            self.demo_button.setText("Stop demo fleet")
            self.reload_key()  # the default key may be new
            names = ", ".join(f"{n.name} ({n.device.name}, {n.device.memory_mb / 1024:.0f} GB)" for n in fleet.nodes)
            self.demo_note.setText(f"DEMO FLEET: {len(fleet.nodes)} simulated nodes on this PC: {names}. Their "
                                   "devices are simulated; their work runs on this PC's CPU.")
            self.demo_note.show()
            self.banner.info(DEMO_NEXT)
            self.refresh()

        def failed(message: str) -> None:
            self._demo_task = None
            self.demo_button.setEnabled(True)
            self.banner.error(f"The demo fleet did not start: {message}")

        self._demo_task = self.tasks.start(lambda report, cancel: backend.start_demo(settings, count, report),
                                           "demo fleet", progressed=lambda p: self.banner.info(f"{p.text}…"),
                                           succeeded=started, failed=failed)

    def stop_demo_node(self, name: str) -> None:
        """Switches one demo node off (its agent and workers end), off the GUI thread."""
        if self.demo is None:
            return
        demo = self.demo
        self.banner.info(f"Switching demo node {name} off…")
        self.tasks.start(lambda report, cancel: demo.stop(name), "stop demo node",
                         succeeded=lambda node: (self.banner.info(f"Demo node {node.name} is off."), self.refresh()),
                         failed=lambda message: self.banner.error(f"Stopping {name} failed: {message}"))

    def stop_demo(self) -> None:
        """Stops every demo node, off the GUI thread."""
        demo, self.demo = self.demo, None
        if demo is None:
            return
        self.demo_button.setEnabled(False)

        def done(_=None) -> None:
            self.demo_button.setEnabled(True)
            self.demo_button.setText("Try a demo fleet")
            self.demo_note.hide()
            self.banner.info("Demo fleet stopped.")
            self.refresh()

        self.tasks.start(lambda report, cancel: demo.close(), "stop demo fleet", succeeded=done,
                         failed=lambda message: (done(), self.banner.error(f"Stopping the demo fleet: {message}")))


@dataclasses.dataclass
class _Gone:
    """Enough of a NodeInfo to drop a discovered node."""

    node_id: str
    port: int = 0
    addresses: list = dataclasses.field(default_factory=list)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]
