"""The Placement view: which machine runs which layers, drawn and priced live.

A fleet profile (``engine.fleet.survey``: run here with "Profile fleet", or the last
``fleet-profile.json`` of the data folder) gives the model's layers and one lane per node and
device; ``fleetgui.placement_model.PlanModel`` holds the plan over it and prices every change.

- ``PlanCanvas`` draws the plan: the layer bar with the range boundaries as handles, the lanes with
  their ranges and memory fill.  Dragging a range onto another lane (press, move, release) goes
  through the model's ``mimeData``/``dropMimeData``, inside the widget (no ``QDrag``, so it works
  offscreen and tests drive it with mouse events); dragging a boundary moves it; right click pins,
  unpins or splits a range.  The predicted tok/s and the memory bars follow while dragging.
- The tree beside it shows the same model (checkboxes pin; its drag and drop is Qt's own, ending in
  the same ``dropMimeData``).

An admin's path: "Use these PCs" (a box per machine), "For N people at once" and one "Deploy
the best layout" button, which runs the solver over the PCs ticked (``best_plan``) and deploys what
it finds.  "Profile fleet" ends on that best plan too.  The prediction says, in words, how the plan
drawn compares with the best found, whether it rests on simulated PCs, and after a deployment the
speed the chat measured stands beside it; a PC left out says why in plain words.

The expert's controls sit behind "Details for experts": the solver's objective, "Optimise" (``solve``
with the pinned ranges; for several users without pins ``solve_layout``, which may choose copies
of the model: the one with most stages is drawn, the others are named and deployed with it unless
the drawn chain is changed by hand), "Deploy as drawn", the tree, the plan's timings and the
left-out reasons with their figures.  A plan that cannot work shows why (``evaluate``'s problems,
or ``Infeasible``'s reason).  Deploying ships and starts the plan with a progress bar per part and
Cancel, then hands the deployment to the chat, whose chain on it its parts follow as the status bar
does (``fleetgui.running.Running.deployment_state``: starting, then running); ``preparing`` tells
the fleet view which node's stage is being exported here.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QPoint, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QAction, QColor, QPainter, QPen
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QFileDialog, QGridLayout, QGroupBox, QHBoxLayout,
                               QHeaderView, QLabel, QMenu, QProgressBar, QPushButton, QScrollArea,
                               QSizePolicy, QTreeView, QVBoxLayout, QWidget)

from engine.errors import FleetError
from engine.files import write_json
from engine.fleet.deploy import Deployment
from engine.fleet.fit import measured_key, measured_speeds
from engine.fleet.standby import Standby
from engine.fleet.survey import read_names
from engine.fleet.layout import fastest_for_one, solve_layout
from engine.fleet.placement import Fleet, Infeasible, left_out, left_out_plainly, solve
from engine.manifest import layer_numbers, layer_span, part_name
from engine.progress import Progress, byte_count
from fleetgui.placement_model import GB, PlanModel, StageRange, default_profile, parse_profile
from fleetgui.running import DEPLOYMENT_STATES, FAILED, STARTING, Running, deployment_where, model_name
from fleetgui.theme import SERIES
from fleetgui.widgets import Banner, ModelField, combo_box, flow_bar, plain, spin_box, splitter
from fleetgui.workers import TaskRunner

# share of a stage's progress bar each deployment phase fills (stage 0 only exports and connects)
PHASES = {"export": (0.0, 0.3), "send": (0.3, 0.8), "start": (0.8, 1.0)}
STAGE0_PHASES = {"export": (0.0, 0.6), "connect": (0.6, 1.0)}
# a plan of the whole model on this PC is how the chat runs without a deployment: said, not refused
ALONE = ("This PC alone runs this layout: the chat already runs this way, so there is nothing to deploy. "
         "For several people at once, set how many and click Deploy the best layout.")


class PlanCanvas(QWidget):
    """The layer bar and the lanes, drawn; ranges and boundaries dragged with the mouse."""

    def __init__(self, model: PlanModel, parent: QWidget | None = None):
        super().__init__(parent)
        self.model = model
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self._drag = None  # ("boundary", stage index) or ("range", stage index, QPoint)
        self._hover_lane = None
        self.model.planChanged.connect(self.update)
        self.model.modelReset.connect(self.updateGeometry)

    # --- geometry (from the font: it scales with the system font) -----------------------------------

    @property
    def line(self) -> int:
        return self.fontMetrics().height()

    def _label_width(self) -> int:
        fm = self.fontMetrics()
        widest = max((fm.horizontalAdvance(lane.label) for lane in self.model.lanes), default=0)
        return min(widest + self.line, max(self.width() // 3, self.line * 6))

    def _memory_width(self) -> int:
        return self.fontMetrics().horizontalAdvance("00.00 / 00.0 GB") + self.line

    def track(self) -> tuple[int, int]:
        """(x, width) of the layer axis."""
        x = self.line // 2 + self._label_width()
        return x, max(self.line * 4, self.width() - x - self._memory_width() - self.line)

    def ruler_rect(self) -> QRectF:
        x, w = self.track()
        return QRectF(x, self.line * 1.6, w, self.line * 1.6)

    def lane_rect(self, lane: int) -> QRectF:
        x, w = self.track()
        top = self.ruler_rect().bottom() + self.line * 1.0 + lane * self.line * 2.4
        return QRectF(x, top, w, self.line * 1.9)

    def layer_x(self, layer: float) -> float:
        x, w = self.track()
        return x + w * layer / max(1, self.model.shape.num_layers)

    def boundary_point(self, index: int) -> QPoint:
        """Where the handle of the boundary after stage ``index`` is."""
        r = self.ruler_rect()
        return QPoint(round(self.layer_x(self.model.stages[index].end)), round(r.center().y()))

    def block_rect(self, stage: int) -> QRectF:
        s = self.model.stages[stage]
        lane = self.lane_rect(s.lane)
        return QRectF(self.layer_x(s.start), lane.top(), self.layer_x(s.end) - self.layer_x(s.start), lane.height())

    def block_point(self, stage: int) -> QPoint:
        return self.block_rect(stage).center().toPoint()

    def lane_point(self, lane: int, layer: float | None = None) -> QPoint:
        r = self.lane_rect(lane)
        x = r.center().x() if layer is None else self.layer_x(layer)
        return QPoint(round(x), round(r.center().y()))

    def lane_at(self, y: float) -> int | None:
        for i in range(len(self.model.lanes)):
            r = self.lane_rect(i)
            if r.top() - self.line * 0.25 <= y <= r.bottom() + self.line * 0.25:
                return i
        return None

    def stage_at(self, pos) -> int | None:
        for i in range(len(self.model.stages)):
            r = self.block_rect(i)
            if r.contains(pos.x(), pos.y()):
                return i
        # the layer bar shows every range too
        if self.model.loaded and self.ruler_rect().contains(pos.x(), pos.y()):
            for i, s in enumerate(self.model.stages):
                if self.layer_x(s.start) <= pos.x() < self.layer_x(s.end):
                    return i
        return None

    def boundary_at(self, pos) -> int | None:
        if not self.model.loaded:
            return None
        r = self.ruler_rect()
        bottom = self.lane_rect(len(self.model.lanes) - 1).bottom() if self.model.lanes else r.bottom()
        if not r.top() - self.line * 0.3 <= pos.y() <= bottom:
            return None
        grab = max(4.0, self.line * 0.4)
        best = None
        for i, s in enumerate([] if self.model.ranks else self.model.stages[:-1]):
            gap = abs(self.layer_x(s.end) - pos.x())
            if gap <= grab and (best is None or gap < best[0]):
                best = (gap, i)
        return None if best is None else best[1]

    def sizeHint(self) -> QSize:
        lanes = max(1, len(self.model.lanes))
        height = self.lane_rect(lanes - 1).bottom() + self.line if self.model.loaded else self.line * 10
        return QSize(self.line * 40, int(height))

    def minimumSizeHint(self) -> QSize:
        return QSize(self.line * 20, self.line * 8)

    # --- painting ------------------------------------------------------------------------------------

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        text = pal.windowText().color()
        if not self.model.loaded:
            p.setPen(text)
            p.drawText(self.rect().adjusted(self.line, self.line, -self.line, -self.line),
                       Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                       "No fleet profile yet. Click Profile fleet to measure this PC and the nodes the Fleet "
                       "view lists, or open a profile written by `fleet profile`.")
            return
        m, line = self.model, self.line
        x0, w = self.track()
        ruler = self.ruler_rect()
        p.setPen(text)
        p.drawText(QRectF(line / 2, ruler.top(), x0 - line, ruler.height()), Qt.AlignmentFlag.AlignVCenter,
                   f"{m.shape.name}: {m.shape.num_layers} layers")
        p.drawText(QRectF(x0, line * 0.2, w, line * 1.3), Qt.AlignmentFlag.AlignVCenter, "layers")
        for i, s in enumerate(m.stages):  # the layer bar: each range in its lane's colour
            colour = QColor(SERIES[s.lane % len(SERIES)])
            seg = QRectF(self.layer_x(s.start), ruler.top(), self.layer_x(s.end) - self.layer_x(s.start),
                         ruler.height())
            p.fillRect(seg, colour)
            p.setPen(QColor("#ffffff"))
            p.drawText(seg, Qt.AlignmentFlag.AlignCenter, layer_numbers(s.start, s.end))
        p.setPen(QPen(text, 1))
        p.drawRect(ruler)
        step = max(1, m.shape.num_layers // 16)
        for layer in range(0, m.shape.num_layers + 1, step):  # ticks
            x = self.layer_x(layer)
            p.drawLine(int(x), int(ruler.bottom()), int(x), int(ruler.bottom() + line * 0.3))
        for i, lane in enumerate(m.lanes):
            r = self.lane_rect(i)
            colour = QColor(SERIES[i % len(SERIES)])
            p.setPen(text)
            p.drawText(QRectF(line / 2, r.top(), x0 - line, r.height()),
                       Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, lane.label)
            back = QColor(pal.base().color())
            if self._hover_lane == i and self._drag and self._drag[0] == "range":
                back = QColor(colour.lighter(180))
            p.fillRect(r, back)
            p.setPen(QPen(pal.mid().color(), 1))
            p.drawRect(r)
            self._paint_memory(p, i, r)
        for i, s in enumerate(m.stages):
            self._paint_block(p, i, s)
        p.setPen(QPen(text, 2))
        bottom = self.lane_rect(len(m.lanes) - 1).bottom()
        for s in ([] if m.ranks else m.stages[:-1]):  # boundary handles across the layer bar and lanes
            x = self.layer_x(s.end)
            p.drawLine(int(x), int(ruler.top() - line * 0.2), int(x), int(bottom))
            p.fillRect(QRectF(x - line * 0.2, ruler.center().y() - line * 0.45, line * 0.4, line * 0.9), text)
        if self._drag and self._drag[0] == "range" and self._drag[2] is not None:
            block = self.block_rect(self._drag[1])
            ghost = QRectF(block)
            ghost.moveCenter(self._drag[2].toPointF())
            ghost.moveLeft(block.left())
            p.setPen(QPen(text, 1, Qt.PenStyle.DashLine))
            p.drawRect(ghost)

    def _paint_block(self, p: QPainter, i: int, s: StageRange) -> None:
        r = self.block_rect(i).adjusted(1, 3, -1, -3)
        colour = QColor(SERIES[s.lane % len(SERIES)])
        p.fillRect(r, colour)
        if s.pinned:
            p.setPen(QPen(QColor("#1d2733"), 3))
            p.drawRect(r)
        p.setPen(QColor("#ffffff"))
        label = self.block_label(i)
        if self.fontMetrics().horizontalAdvance(label) > r.width() - 4:
            label = layer_numbers(s.start, s.end) + (" ⚑" if s.pinned else "")
        p.drawText(r, Qt.AlignmentFlag.AlignCenter, label)

    def block_label(self, i: int) -> str:
        """What a range's block says (in full, where it has the room)."""
        s = self.model.stages[i]
        pinned = " · held in place" if s.pinned else ""
        what = f"part {i + 1}: 1/{len(self.model.stages)} of" if self.model.ranks else f"part {i + 1}:"
        return f"{what} {layer_numbers(s.start, s.end)} · {self.model.stage_ms(i):.2f} ms{pinned}"

    def _paint_memory(self, p: QPainter, lane: int, r: QRectF) -> None:
        used, limit = self.model.lane_memory(lane), self.model.lanes[lane].memory_bytes
        share = used / limit if limit else 0.0
        bar = QRectF(r.right() + self.line * 0.5, r.top() + r.height() * 0.15, self._memory_width() - self.line * 0.5,
                     r.height() * 0.7)
        p.setPen(QPen(self.palette().mid().color(), 1))
        p.drawRect(bar)
        fill = QRectF(bar)
        fill.setWidth(bar.width() * min(1.0, share))
        p.fillRect(fill, QColor("#c0392b" if share > 1 else "#d4ac0d" if share > 0.85 else "#27ae60"))
        p.setPen(self.palette().windowText().color())
        p.drawText(bar, Qt.AlignmentFlag.AlignCenter, f"{used / GB:.2f} / {limit / GB:.1f} GB")

    # --- the mouse -----------------------------------------------------------------------------------

    def mousePressEvent(self, event) -> None:
        pos = event.position()
        if event.button() == Qt.MouseButton.RightButton:
            stage = self.stage_at(pos)
            if stage is not None:
                self.context_menu(stage).popup(event.globalPosition().toPoint())
            return
        if event.button() != Qt.MouseButton.LeftButton:
            return
        boundary = self.boundary_at(pos)
        if boundary is not None:
            self._drag = ("boundary", boundary)
            return
        stage = self.stage_at(pos)
        if stage is not None:
            self._drag = ("range", stage, None)

    def mouseMoveEvent(self, event) -> None:
        pos = event.position()
        if self._drag is None:
            hover = self.boundary_at(pos) is not None
            on_range = self.stage_at(pos) is not None
            self.setCursor(Qt.CursorShape.SplitHCursor if hover else
                           Qt.CursorShape.OpenHandCursor if on_range else Qt.CursorShape.ArrowCursor)
            return
        if self._drag[0] == "boundary":
            x, w = self.track()
            layer = round((pos.x() - x) / w * self.model.shape.num_layers)
            self.model.move_boundary(self._drag[1], layer)
        else:
            self._drag = ("range", self._drag[1], pos.toPoint())
            self._hover_lane = self.lane_at(pos.y())
            self.update()

    def mouseReleaseEvent(self, event) -> None:
        drag, self._drag, self._hover_lane = self._drag, None, None
        if drag is not None and drag[0] == "range":
            lane = self.lane_at(event.position().y())
            if lane is not None and lane != self.model.stages[drag[1]].lane:
                self.drop_range(drag[1], lane)
        self.update()

    def drop_range(self, stage: int, lane: int) -> bool:
        """What releasing a dragged range over a lane does: the model's own drag and drop."""
        data = self.model.mimeData([self.model.range_index(stage)])
        return self.model.dropMimeData(data, Qt.DropAction.MoveAction, -1, 0, self.model.lane_index(lane))

    def context_menu(self, stage: int) -> QMenu:
        s = self.model.stages[stage]
        menu = QMenu(self)
        pin = QAction("Unpin this range" if s.pinned else "Pin this range", menu)
        pin.triggered.connect(lambda: self.model.set_pinned(stage, not s.pinned))
        split = QAction("Split in two", menu)
        split.setEnabled(s.end - s.start > 1)
        split.triggered.connect(lambda: self.model.split(stage))
        menu.addAction(pin)
        menu.addAction(split)
        menu.aboutToHide.connect(menu.deleteLater)
        return menu


def _copy_words(plan) -> str:
    """Where a copy of the model runs, in words (node ids, made readable by the caller)."""
    return ", then ".join(f"{layer_span(s.start, s.end)} on {s.node}" for s in plan.stages)


@dataclasses.dataclass(frozen=True)
class Best:
    """The best the solver found, and for what: a plan drawn since is compared with it."""

    objective: str
    users: int
    pcs: tuple[str, ...]  # the nodes ticked in "Use these PCs"
    tok_s: float  # predicted: for one person (latency), or all together (throughput)


def best_plan(shape, fleet, objective: str, users: int, pins=()) -> tuple:
    """What the solver finds best for ``users`` by ``objective`` with ``pins`` (off the GUI thread):
    (the plan to draw; why each node it leaves out is left out, as (plain words, with the figures);
    the other copies of the model; the Layout or None).  Raises Infeasible.  For several users
    without pins ``solve_layout`` may choose copies: the one with most stages is drawn (else one on
    another PC: one whole here is not a deployment of its own); for one user two PCs as
    tensor-parallel ranks may beat a chain."""
    if objective == "throughput" and not pins:
        layout = solve_layout(shape, fleet, users=users)
        plan, *others = sorted(layout.plans, key=lambda p: (-len(p.stages), p.stages[0].node == fleet.coordinator))
    else:
        plan, others, layout = solve(shape, fleet, objective=objective, users=users, pins=list(pins)), [], None
        if objective == "latency" and not pins:
            plan = fastest_for_one(shape, fleet, plan)
    used = {s.node for p in others for s in p.stages}
    words = left_out_plainly(shape, fleet, plan)
    left = {node: (words[node], why) for node, why in left_out(shape, fleet, plan).items() if node not in used}
    return plan, left, others, layout


class PlacementView(QWidget):
    deployed = Signal(object)  # engine.fleet.deploy.Deployment, running and saved
    preparing = Signal(str, str)  # an agent's address, and what this view is doing for it ("" when done)

    def __init__(self, settings, backend, tasks: TaskRunner, agents: Callable[[], list[str]] = lambda: [],
                 running: Running | None = None, parent: QWidget | None = None):
        """``running``: the app's running state; once the chat runs on this view's deployment, its
        parts say what the status bar says (``Running.deployment_state``)."""
        super().__init__(parent)
        self.settings = settings
        self.backend = backend
        self.tasks = tasks
        self.agents = agents
        self.running = running or Running(self)
        self.running.changed.connect(self._follow_running)
        self.doc: dict | None = None
        self.deployment = None
        self.owns_deployment = False  # deployed by this session (stopped at exit), or adopted from a record
        self.task = None  # the running survey, solve or deployment
        self.deploying: list[str] = []  # the running deployment's agents, by stage
        self.model = PlanModel(self)
        self.copies: tuple[list, list] = ([], [])  # the chain the solver drew, and the other copies it chose
        self.banner = Banner()

        self.best: Best | None = None  # the best the solver found
        self.deployed_at: float | None = None  # when this view's deployment started (its measured speed is later)
        self.deployed_prediction = 0.0  # its predicted tok/s for one person
        self._deploy_when_solved = False  # "Deploy the best layout": the solve ends in a deployment

        self.source = ModelField(settings.default_model)  # the model to place
        self.profile_button = QPushButton("Profile fleet")
        self.profile_button.setToolTip("measure this PC and every node the Fleet view reaches for this model, "
                                       "then find the best layout")
        self.profile_button.clicked.connect(self.profile_fleet)
        self.open_button = QPushButton("Open profile…")
        self.open_button.clicked.connect(self._ask_open_profile)

        # the admin's controls: which PCs, for how many people, and one button
        self.pcs_box = QWidget()
        self.pcs_bar, self.pcs_layout = flow_bar()
        self.pc_checks: dict[str, QCheckBox] = {}  # node id: "use this PC"
        self.users = spin_box(1, 64, 1)
        self.users.setToolTip("how many people chat (or programs call the API) at the same time")
        self.users.valueChanged.connect(self.model.set_users)
        self.users.valueChanged.connect(self._users_changed)
        self.best_button = QPushButton("Deploy the best layout")
        self.best_button.setObjectName("primary")
        self.best_button.setToolTip("find the fastest layout over the PCs ticked, for that many people, and start it")
        self.best_button.clicked.connect(self.deploy_best)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.stop_button = QPushButton("Stop deployment")
        self.stop_button.clicked.connect(self.stop_deployment)

        # the expert's: the solver's objective, Optimise, deploying the plan as drawn, a recorded deployment
        self.objective = combo_box(["latency", "throughput"])
        self.optimise_button = QPushButton("Optimise")
        self.optimise_button.setToolTip("let the solver choose the ranges; pinned ranges stay where they are")
        self.optimise_button.clicked.connect(self.optimise)
        self.deploy_button = QPushButton("Deploy as drawn")
        self.deploy_button.setToolTip("deploy the plan drawn below, edits and all")
        self.deploy_button.clicked.connect(self.deploy)
        self.record_button = QPushButton("Use recorded deployment")
        self.record_button.setToolTip("chat on the chain `fleet deploy` or `fleet up --no-chat` left running "
                                      "(deployment.json in the data folder)")
        self.record_button.clicked.connect(lambda: self.use_recorded())
        self.details_button = QPushButton("Details for experts")
        self.details_button.setCheckable(True)
        self.details_button.setToolTip("the solver's objective, the stages as a list, pins and the plan's timings")
        self.details_button.toggled.connect(self._show_details)

        # rows that wrap in a narrow window rather than widen it: the model field keeps the line's room
        top = QHBoxLayout()
        top.addWidget(QLabel("Model"))
        top.addWidget(self.source, 1)
        top.addWidget(flow_bar(self.profile_button, self.open_button, align_right=True)[0])
        pcs_row = QHBoxLayout(self.pcs_box)
        pcs_row.setContentsMargins(0, 0, 0, 0)
        pcs_row.addWidget(QLabel("Use these PCs:"))
        pcs_row.addWidget(self.pcs_bar, 1)
        plan_row = QHBoxLayout()
        plan_row.addWidget(flow_bar(QLabel("For"), self.users, QLabel("people at once"))[0], 1)
        plan_row.addWidget(flow_bar(self.details_button, self.cancel_button, self.stop_button, self.best_button,
                                    align_right=True)[0], 1)

        self.activity = plain(QLabel())  # paths, nodes' names and progress
        self.activity.setObjectName("hint")
        self.activity.setWordWrap(True)
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setMaximumWidth(self.fontMetrics().averageCharWidth() * 24)
        busy_row = QHBoxLayout()
        busy_row.addWidget(self.activity, 1)
        busy_row.addWidget(self.busy)
        self.prediction = plain(QLabel())  # the plan's speed, how it compares with the best, what it rests on
        self.prediction.setObjectName("prediction")
        font = self.prediction.font()
        font.setBold(True)
        self.prediction.setFont(font)
        self.prediction.setWordWrap(True)
        self.measured = plain(QLabel())  # the deployment's speed in the chat, beside the prediction
        self.measured.setWordWrap(True)
        self.left_out = plain(QLabel())  # why a PC is not used, in plain words
        self.left_out.setWordWrap(True)
        self.problems = plain(QLabel())
        self.problems.setObjectName("problems")
        self.problems.setWordWrap(True)
        self.problems.setStyleSheet("color: #c0392b;")
        self.problems.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.canvas = PlanCanvas(self.model)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.canvas)
        self.tree = QTreeView()
        self.tree.setModel(self.model)
        self.tree.setDragDropMode(QAbstractItemView.DragDropMode.DragDrop)
        self.tree.setDefaultDropAction(Qt.DropAction.MoveAction)
        self.tree.setDragEnabled(True)
        self.tree.setAcceptDrops(True)
        self.tree.setDropIndicatorShown(True)
        self.tree.setUniformRowHeights(True)
        self.tree.header().setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        self.model.modelReset.connect(self.tree.expandAll)
        split = splitter(Qt.Orientation.Horizontal, (scroll, 3), (self.tree, 1))
        chars = self.fontMetrics().averageCharWidth()
        split.setSizes([chars * 110, chars * 36])

        self.deploy_box = QGroupBox("Deployment")
        self.deploy_grid = QGridLayout(self.deploy_box)
        self.deploy_bars: list[tuple[QLabel, QProgressBar]] = []
        self.deploy_box.hide()

        self.details = QWidget()  # what only an expert needs, behind "Details for experts"
        self.technical = plain(QLabel())  # the plan's timings in the solver's terms
        self.technical.setObjectName("hint")
        self.technical.setWordWrap(True)
        self.reasons = plain(QLabel())  # the left-out PCs' reasons with their figures
        self.reasons.setObjectName("hint")
        self.reasons.setWordWrap(True)
        hint = QLabel("Drag a range onto another lane to move those layers there; drag the handles between ranges "
                      "to move a boundary; right click a range (or tick it in the list) to pin it.")
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        details = QVBoxLayout(self.details)
        details.setContentsMargins(0, 0, 0, 0)
        details.addWidget(flow_bar(QLabel("Objective"), self.objective, self.optimise_button, self.deploy_button,
                                   self.record_button)[0])
        details.addWidget(self.technical)
        details.addWidget(self.reasons)
        details.addWidget(hint)
        self.details.hide()
        self.tree.hide()

        layout = QVBoxLayout(self)
        layout.addWidget(self.banner)
        layout.addLayout(top)
        layout.addWidget(self.pcs_box)
        layout.addLayout(plan_row)
        layout.addLayout(busy_row)
        layout.addWidget(self.prediction)
        layout.addWidget(self.measured)
        layout.addWidget(self.left_out)
        layout.addWidget(self.problems)
        layout.addWidget(self.details)
        layout.addWidget(split, 1)
        layout.addWidget(self.deploy_box)
        self.model.planChanged.connect(self._show_evaluation)
        self._set_busy(None)
        self._show_evaluation()
        path = default_profile()
        if path.exists():
            try:
                self.load_profile(json.loads(path.read_text()))
                self.activity.setText(f"Last fleet profile: {path}")
            except (OSError, ValueError, FleetError) as exc:
                self.banner.error(f"The last fleet profile ({path}) cannot be read: {exc}")

    # --- the profile ---------------------------------------------------------------------------------

    def load_profile(self, doc: dict) -> None:
        doc = read_names(doc)  # an older profile's name for this PC, as the app says it now
        self.model.load(doc)
        self.doc = doc
        self.best, self.copies = None, ([], [])
        if doc.get("source"):
            self.source.set_source(str(doc["source"]))
        self._list_pcs()
        self._set_busy(None if self.task is None else self.activity.text())
        self._show_evaluation()

    def _list_pcs(self) -> None:
        """A "use this PC" box per machine of the profile, all ticked; this PC's always (it runs the chat)."""
        for box in self.pc_checks.values():
            self.pcs_layout.removeWidget(box)
            box.deleteLater()
        self.pc_checks = {}
        for node in dict.fromkeys(lane.node for lane in self.model.lanes):
            lane = next(lane for lane in self.model.lanes if lane.node == node)
            box = QCheckBox(lane.name + (" (simulated)" if lane.simulated else ""))
            box.setChecked(True)
            if node == self.model.fleet.coordinator:
                box.setEnabled(False)
                box.setToolTip("this PC always takes part: it runs the chat")
            box.toggled.connect(self._show_evaluation)
            self.pcs_layout.addWidget(box)
            self.pc_checks[node] = box

    def pcs_in_use(self) -> list[str]:
        return [node for node, box in self.pc_checks.items() if box.isChecked()]

    def _fleet_in_use(self):
        """The profile's fleet without the PCs not ticked in "Use these PCs"."""
        fleet, used = self.model.fleet, set(self.pcs_in_use())
        return Fleet(devices=[d for d in fleet.devices if d.node in used], rtt_ms=fleet.rtt_ms,
                     coordinator=fleet.coordinator)

    def _users_changed(self, users: int) -> None:
        """One person is served best by the quickest answer, several by the most words in all."""
        self.objective.setCurrentText("latency" if users == 1 else "throughput")

    def _show_details(self, shown: bool) -> None:
        self.details.setVisible(shown)
        self.tree.setVisible(shown)
        self.details_button.setText("Hide details" if shown else "Details for experts")

    def _ask_open_profile(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Fleet profile", str(default_profile()), "JSON (*.json)")
        if path:
            self.open_profile(Path(path))

    def open_profile(self, path: Path) -> None:
        try:
            self.load_profile(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            self.banner.error(f"Cannot read {path}: {exc}")
        except FleetError as exc:
            self.banner.error(f"{path}: {exc}")

    def profile_fleet(self) -> None:
        """Surveys this PC and the reachable nodes off the GUI thread, then shows the result."""
        if self.task is not None:
            return
        model, agents, settings, backend = self.source.source(), self.agents(), self.settings, self.backend
        if not model:
            self.banner.error("Name the model to place first.")
            return

        objective, users = self.objective.currentText(), self.users.value()

        def run(report, cancel):
            doc = backend.survey(model, agents, settings, report, cancel)
            write_json(default_profile(), doc)
            report(Progress("Finding the best layout"))
            shape, _, fleet = parse_profile(doc)
            try:
                return doc, best_plan(shape, fleet, objective, users)
            except Infeasible as exc:
                return doc, str(exc)

        where = f"this PC and {len(agents)} node{'s' if len(agents) != 1 else ''}" if agents else \
            "this PC only (no node answers in the Fleet view)"
        self._set_busy(f"Profiling {model} on {where}…")
        self.task = self.tasks.start(run, "survey", progressed=self._progress, succeeded=self._profiled,
                                     failed=lambda m: self._failed("Profiling the fleet failed", m),
                                     cancelled=self._task_cancelled)

    def _profiled(self, result) -> None:
        """Shows the profile with the best plan the solver found on it (what Optimise would find)."""
        doc, solved = result
        self.task = None
        self._set_busy(None)
        try:
            self.load_profile(doc)
        except FleetError as exc:
            self.banner.error(str(exc))
            return
        self._optimised((solved, []) if not isinstance(solved, str) else (None, solved))
        self.activity.setText(f"Fleet profiled: {len(self.model.lanes)} devices on {len(doc['nodes'])} PCs; "
                              f"saved to {default_profile()}. " + self.activity.text())

    # --- optimise ------------------------------------------------------------------------------------

    def optimise(self) -> None:
        if self.task is not None or not self.model.loaded:
            return
        shape, fleet, pins = self.model.shape, self._fleet_in_use(), self.model.pins()
        objective, users = self.objective.currentText(), self.users.value()

        def run(report, cancel):
            try:
                return best_plan(shape, fleet, objective, users, pins), pins
            except Infeasible as exc:
                return None, str(exc)

        self._set_busy(f"Finding the best layout for {users} {'person' if users == 1 else 'people'}"
                       + (f" with {len(pins)} pinned range(s)…" if pins else "…"))
        self.task = self.tasks.start(run, "solve", succeeded=self._optimised,
                                     failed=lambda m: self._failed("Optimising failed", m),
                                     cancelled=self._task_cancelled)

    def deploy_best(self) -> None:
        """"Deploy the best layout": the solver's best over the PCs ticked, for that many people, started."""
        if self.task is not None or not self.model.loaded:
            return
        for s in self.model.stages:  # the admin asks for the best: nothing held in place by hand
            s.pinned = False
        self._deploy_when_solved = True
        self.optimise()

    def _optimised(self, result) -> None:
        self.task = None
        self._set_busy(None)
        deploy, self._deploy_when_solved = self._deploy_when_solved, False
        solved, pins = result
        if solved is None:
            self.infeasible = self.model.readable(pins)
            self.problems.setText(f"Infeasible: {self.infeasible}")
            self.activity.setText("The solver found no placement; the plan shown is unchanged.")
            return
        self.infeasible = None
        plan, left, others, layout = solved
        if not pins:
            value = (layout.aggregate_tok_s if layout is not None else
                     plan.tok_s if plan.objective == "latency" else plan.aggregate_tok_s)
            self.best = Best(self.objective.currentText(), self.users.value(), tuple(self.pcs_in_use()), value)
        self.model.set_plan(plan, pins)
        self.copies = (self.model.chain(), [self.model.placement_of(p) for p in others])
        self.left_out.setText("\n".join(self.model.readable(f"{node} is left out: {words}.")
                                        for node, (words, _) in left.items()))
        self.reasons.setText("\n".join(self.model.readable(f"Left out {node}: {detail}.")
                                       for node, (_, detail) in left.items()))
        self._show_evaluation()
        said = [f"Optimised in {plan.solve_ms:.0f} ms."]
        if plan.ranks:
            said.append(f"{len(plan.stages)} PCs working on each token together serve {plan.users} "
                        f"{'person' if plan.users == 1 else 'people'} best: each computes its share of every layer.")
        if others:
            where = "; ".join(_copy_words(p) for p in others)
            said.append(self.model.readable(
                f"{len(others) + 1} copies of the model serve {layout.users} people best: the one drawn, and {where} "
                f"({layout.aggregate_tok_s:.1f} tok/s aggregate predicted). Deploy starts them all."))
        self.activity.setText(" ".join(said))
        if deploy:
            self.deploy()

    # --- deploy --------------------------------------------------------------------------------------

    def alone_here(self) -> bool:
        """Whether the plan drawn is the whole model on this PC (no deployment: the chat runs so by itself)."""
        chain = self.model.chain()
        return len(chain) == 1 and not self.model.ranks and chain[0][0] == self.model.fleet.coordinator

    def deploy(self) -> None:
        if self.task is not None or not self.model.loaded:
            return
        if self.alone_here() and not self.model.evaluation.problems:
            self.banner.info(ALONE)
            return
        if self.model.problems:
            self.banner.error("This plan cannot be deployed: " + "; ".join(self.model.problems))
            return
        model = str((self.doc or {}).get("source") or self.source.source())
        weights = str((self.doc or {}).get("weights") or self.settings.weights)
        settings = dataclasses.replace(self.settings, weights=weights)
        stages, previous, owned, backend = self.model.placement(), self.deployment, self.owns_deployment, self.backend
        drawn, others = self.copies
        copies = others if drawn == self.model.chain() else []  # a chain redrawn by hand is deployed alone
        planned = None
        if self.doc:  # the profile the plan came from: the chat's failover re-plans with it if a node is lost
            profile = default_profile().with_name("deployed-profile.json")
            write_json(profile, self.doc, indent=None)
            planned = {"profile": str(profile), "objective": self.objective.currentText(), "users": self.users.value()}

        def run(report, cancel):
            if previous is not None and owned:  # one deployment at a time: the old chain's workers go first
                report(Progress("Stopping the previous deployment"))
                backend.stop_deployment(previous, settings)
            deployment = backend.deploy(model, stages, settings, report, cancel, planned, copies)
            if cancel.is_set():  # cancelled after the last point deploy() looks: undo it
                backend.stop_deployment(deployment, settings)
                return None
            return deployment

        self.deployment, self.deployed_at = None, None
        self.deployed_prediction = self.tok_s
        self.show_measured()
        self.deploying = [s.node for s in stages]
        self._reset_bars(stages)
        self._set_busy(f"Deploying {model} ({weights}) in {len(stages)} "
                       f"{'shares of every step' if self.model.ranks else 'parts'}…")
        self.task = self.tasks.start(run, "deploy", progressed=self._progress, succeeded=self._deployed,
                                     failed=lambda m: self._failed("Deployment failed", m),
                                     cancelled=self._task_cancelled)

    def _reset_bars(self, stages) -> None:
        while self.deploy_grid.count():
            item = self.deploy_grid.takeAt(0)
            if item.widget():
                item.widget().deleteLater()
        self.deploy_bars = []
        for i, s in enumerate(stages):
            lane = self.model.lanes[self.model.stages[i].lane]
            name = plain(QLabel(f"part {i + 1}: {lane.label}, "
                                + (f"1/{len(stages)} of every layer" if s.rank is not None else
                                   layer_span(s.start, s.end))))
            phase = plain(QLabel("waiting"))
            phase.setObjectName("hint")
            bar = QProgressBar()
            bar.setRange(0, 1000)
            bar.setValue(0)
            self.deploy_grid.addWidget(name, i, 0)
            self.deploy_grid.addWidget(bar, i, 1)
            self.deploy_grid.addWidget(phase, i, 2)
            self.deploy_bars.append((phase, bar))
        self.deploy_grid.setColumnStretch(1, 1)
        self.deploy_box.show()

    def _progress(self, progress: Progress) -> None:
        if progress.stage is None:  # a status line, or a step of the model's download (which goes on: "…")
            # a download shows its share on the bar; after it (and for every other step) the bar is
            # busy: never "100%" while the survey goes on
            self.activity.setText(f"{progress.text}…" if progress.step else progress.text)
            if progress.fraction is None:
                self.busy.setRange(0, 0)
            else:
                self.busy.setRange(0, 100)
                self.busy.setValue(round(progress.fraction * 100))
            return
        stage, phase, fraction = progress.stage, progress.step, progress.fraction  # a deployment's
        if 0 <= stage < len(self.deploy_bars):
            label, bar = self.deploy_bars[stage]
            lo, hi = (STAGE0_PHASES if stage == 0 else PHASES).get(phase, (0.0, 1.0))
            bar.setValue(int(1000 * (lo + (hi - lo) * fraction)))
            label.setText(f"sending {byte_count(progress.bytes_done, progress.bytes_total)}"
                          if progress.bytes_total is not None else f"{phase} {fraction * 100:.0f}%")
        if 0 < stage < len(self.deploying):
            self.preparing.emit(self.deploying[stage],
                                f"preparing {part_name(stage)} ({fraction * 100:.0f}%)" if phase == "export" else "")

    def use_recorded(self, path: Path | None = None) -> bool:
        """Chats on a deployment recorded by the command line (it keeps running when the app exits)."""
        try:
            deployment = Deployment.load(path)
        except FleetError as exc:
            self.banner.error(str(exc))
            return False
        self.deployment, self.owns_deployment, self.deployed_at = deployment, False, None
        self._set_busy(None)
        self.show_measured()
        self._say_deployed(DEPLOYMENT_STATES[STARTING])
        self.deployed.emit(deployment)  # the chat starts its chain on it: the running state says how it goes
        return True

    def _deployed(self, deployment) -> None:
        self.task = None
        self._set_busy(None)
        self.deployment, self.owns_deployment = deployment, True
        self.deployed_at = time.time()
        for _, bar in self.deploy_bars:
            bar.setValue(1000)
        self._say_deployed(DEPLOYMENT_STATES[STARTING])
        self.show_measured()
        self.deployed.emit(deployment)  # the chat starts its chain on it: the running state says how it goes

    def _follow_running(self) -> None:
        """The deployment's parts and line follow the chat's chain on it, as the status bar does."""
        state = self.running.deployment_state(self.deployment)
        if state and self.task is None:
            self._say_deployed(state)

    def _say_deployed(self, state: str) -> None:
        """Says the deployment and what it is doing (a ``DEPLOYMENT_STATES`` word) on the activity line
        and, for the one this view deployed, each part's label."""
        deployment = self.deployment
        for label, _ in self.deploy_bars if self.owns_deployment else ():
            label.setText(state)
        chat = {DEPLOYMENT_STATES[STARTING]: " The chat is starting on it…",
                DEPLOYMENT_STATES[FAILED]: " The chat could not start on it: see the Chat view."}.get(
            state, " The chat now uses this deployment.")
        what = (f"Deployed {self._where(deployment)}." if self.owns_deployment else
                f"The recorded deployment: {self._where(deployment)}.")
        self.activity.setText(what + chat + self._standbys_text(deployment))

    def _names(self) -> dict[str, str]:
        """The profiled PCs' names by address."""
        return {lane.address: lane.name for lane in self.model.lanes} if self.model.loaded else {}

    def _where(self, deployment) -> str:
        """A deployment in words: its model and the PCs each copy runs on ("Qwen2.5 Coder 1.5B on this
        PC + laptop-2, a copy on laptop-3"); its standbys have a sentence of their own."""
        return f"{model_name(deployment.model)} on {deployment_where(deployment, self._names(), standbys=False)}"

    def _standbys_text(self, deployment) -> str:
        """The deployment's hot standbys in a sentence: which PC keeps a spare of which part."""
        names = self._names()
        spares = [f"part {s.stage + 1} on {names.get(s.agent, s.agent)}"
                  for s in map(Standby.from_json, deployment.standbys)]
        if not spares:
            return ""
        return (f" Kept ready as standbys, to take over at once if a PC leaves: {', '.join(spares)}.")

    def stop_deployment(self) -> None:
        deployment, settings, backend = self.deployment, self.settings, self.backend
        if deployment is None or self.task is not None:
            return
        self.deployment, self.deployed_at = None, None
        self.show_measured()
        self.deployed.emit(None)
        self._set_busy("Stopping the deployment's workers…")
        self.task = self.tasks.start(lambda report, cancel: backend.stop_deployment(deployment, settings),
                                     "stop deployment", succeeded=self._stopped,
                                     failed=lambda m: self._failed("Stopping the deployment failed", m))

    def _stopped(self, problems: list[str]) -> None:
        self.task = None
        self._set_busy(None)
        self.deploy_box.hide()
        if problems:
            self.banner.error("Some workers could not be stopped: " + "; ".join(problems))
        else:
            self.activity.setText("Deployment stopped.")

    # --- shared --------------------------------------------------------------------------------------

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.activity.setText("Cancelling…")

    def _failed(self, what: str, message: str) -> None:
        self.task = None
        self._set_busy(None)
        self.banner.error(f"{what}: {message}")
        for label, bar in self.deploy_bars:
            if bar.value() < 1000:
                label.setText("stopped")

    def _task_cancelled(self) -> None:
        self.task = None
        self._set_busy(None)
        self.activity.setText("Cancelled.")

    def _set_busy(self, text: str | None) -> None:
        running = text is not None
        if running:
            self.activity.setText(text)
        else:  # a deployment ended, one way or another: no node is being prepared any more
            for agent in self.deploying[1:]:
                self.preparing.emit(agent, "")
            self.deploying = []
        self.busy.setRange(0, 0)
        self.busy.setVisible(running)
        self.cancel_button.setEnabled(running)
        for b in (self.profile_button, self.open_button, self.record_button):
            b.setEnabled(not running)
        self.stop_button.setEnabled(not running and self.deployment is not None)
        for b in (self.optimise_button, self.deploy_button, self.best_button):
            b.setEnabled(not running and self.model.loaded)

    def _show_evaluation(self) -> None:
        m = self.model
        self.infeasible = None
        if not m.loaded or m.evaluation is None:
            self.prediction.setText("No plan yet.")
            self.technical.setText("")
            self.problems.setText("")
            return
        plan = m.evaluation.plan
        self.technical.setText(
            f"Predicted {plan.tok_s:.1f} tok/s for one user · {plan.aggregate_tok_s:.1f} tok/s aggregate for "
            f"{m.users} user{'s' if m.users != 1 else ''} · {plan.token_ms:.2f} ms per token "
            f"({plan.network_ms:.2f} ms network, {len(m.stages)} "
            + ("tensor-parallel ranks)" if m.ranks else f"stage{'s' if len(m.stages) != 1 else ''})"))
        alone = self.alone_here()
        self.prediction.setText(self.in_words() + (f" {ALONE}" if alone else ""))
        problems = [m.readable(p) for p in m.evaluation.problems] if alone else m.problems  # alone: no refusal
        self.problems.setText("Not deployable: " + "; ".join(problems) if problems else "")

    def in_words(self) -> str:
        """The plan's predicted speed as an admin reads it: for how many people, on which PCs, how it
        compares with the best the solver found for the same people and PCs, and whether it rests
        on simulated PCs."""
        m = self.model
        plan, users = m.evaluation.plan, m.users
        drawn, others = self.copies
        with_copies = bool(others) and drawn == m.chain()  # deployed with the copies the solver chose
        value = (plan.tok_s if self.objective.currentText() == "latency" else
                 self.best.tok_s if with_copies and self.best else plan.aggregate_tok_s)
        who = "for one person" if users == 1 else f"for {users} people at once, all together"
        pcs = list(dict.fromkeys(m.lanes[s.lane].name for s in m.stages))
        text = f"This layout: {value:.1f} tok/s predicted {who}, on {', '.join(pcs)}"
        if with_copies:
            text += f" and {len(others)} more cop{'y' if len(others) == 1 else 'ies'} of the model"
        best = self.best
        if best is not None and (best.objective, best.users, best.pcs) == \
                (self.objective.currentText(), users, tuple(self.pcs_in_use())):
            text += (". It is the best layout found." if value >= best.tok_s * 0.995 else
                     f"; the best found: {best.tok_s:.1f}.")
        else:
            text += ". Deploy the best layout finds the fastest for these people and PCs."
        simulated = sorted({m.lanes[s.lane].name for s in m.stages if m.lanes[s.lane].simulated})
        if simulated:
            text += (f" The prediction rests on simulated PCs ({', '.join(simulated)}): real PCs will be "
                     f"faster or slower.")
        return text

    def show_measured(self) -> None:
        """The deployment's speed as the chat measured it since it started, beside its prediction."""
        deployment = self.deployment
        if deployment is None or self.deployed_at is None:
            self.measured.setText("")
            return
        entry = measured_speeds().get(measured_key(deployment.stage0, deployment.model))  # as the chat keeps it
        predicted = f"predicted {self.deployed_prediction:.1f} tok/s for one person"
        if isinstance(entry, dict) and entry.get("at", 0) >= self.deployed_at and entry.get("decode_tok_s"):
            self.measured.setText(f"Measured in the chat: {entry['decode_tok_s']:.1f} tok/s ({predicted}).")
        else:
            self.measured.setText(f"Measured speed: shown here after the first answer in the chat ({predicted}).")

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.show_measured()

    @property
    def tok_s(self) -> float:
        return self.model.evaluation.plan.tok_s if self.model.evaluation else 0.0

    def apply_settings(self, settings) -> None:
        if settings.default_model != self.settings.default_model and not self.doc:
            self.source.set_source(settings.default_model)
        self.settings = settings

    def shutdown(self) -> None:
        """At exit: the workers this session deployed are stopped (stage 0 lives in this app); a
        recorded deployment it only used keeps running."""
        deployment, self.deployment = self.deployment, None
        if deployment is not None and self.owns_deployment:
            try:
                self.backend.stop_deployment(deployment, self.settings)
            except FleetError:
                pass
