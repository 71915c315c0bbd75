"""The plan the Placement view edits, as a Qt item model.

``PlanModel`` holds a fleet profile (``engine.fleet.survey``: the model's shape, the nodes and a
``Fleet`` of measured devices) and a plan over it: a chain of layer ranges (``StageRange``), each on
a lane (``Lane``: one device of one node).  Lanes are the model's top-level rows and the ranges each
lane runs their children, so any item view can show it.  A range travels as MIME data
(``mimeData``: ``{"start", "end"}``) and ``dropMimeData`` onto a lane, or onto a range of that lane,
moves those layers there; that is the one path every drag takes.  Ranges are checkable, checked
meaning pinned.  Every change is priced at once with ``engine.fleet.placement.evaluate`` (cheap),
and ``problems`` lists what would stop the plan from deploying, in words, nodes named by name:
``evaluate``'s problems and the rule ``engine.fleet.deploy.check_placement`` enforces.  The starting
plan is the engine's even split (``engine.export.exporter.plan_split``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from PySide6.QtCore import QAbstractItemModel, QMimeData, QModelIndex, Qt, Signal

from engine.config import paths
from engine.errors import FleetError
from engine.export.exporter import plan_split
from engine.fleet import survey
from engine.fleet.deploy import LOCAL, placement_problem
from engine.fleet.placement import Fleet, ModelShape, Pin, evaluate, price_ranks
from engine.fleet.span import StageSpan
from engine.manifest import layer_span
from fleetgui.widgets import plain_tip

MIME = "application/x-fleetshard-layers"
GB = 2**30
PROFILE_NAME = "fleet-profile.json"


def default_profile() -> Path:
    return paths().data / PROFILE_NAME


def parse_profile(doc: dict):
    """(ModelShape, nodes, Fleet) of a survey document (an older one's name for this PC read as today's)."""
    try:
        return ModelShape.from_json(doc["model"]), survey.current_names(doc["nodes"]), Fleet.from_json(doc["fleet"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FleetError(f"not a fleet profile written by `fleet profile` or the app ({exc})") from None


@dataclasses.dataclass
class Lane:
    node: str
    device: str
    name: str  # the node's display name
    address: str  # its agent's HOST:PORT, or LOCAL for this machine
    memory_bytes: int
    simulated: bool = False  # a demo node's simulated device (``engine.fleet.demo``)

    @property
    def label(self) -> str:
        return f"{self.name}{' (simulated)' if self.simulated else ''} · {self.device}"


@dataclasses.dataclass
class StageRange:
    lane: int
    start: int
    end: int
    pinned: bool = False


class PlanModel(QAbstractItemModel):
    """Lanes (node, device) at the top level; each lane's layer ranges (stages) as its children."""

    planChanged = Signal()  # stages or their evaluation changed
    COLUMNS = ("Lane / layers", "Stage")

    def __init__(self, parent=None):
        super().__init__(parent)
        self.shape = None
        self.nodes: dict = {}
        self.fleet = None
        self.lanes: list[Lane] = []
        self.stages: list[StageRange] = []  # chain order (by first layer), or rank order
        self.ranks = False  # the stages are tensor-parallel ranks, each with every layer (``price_ranks``)
        self.users = 1
        self.evaluation = None
        self.problems: list[str] = []

    # --- loading -------------------------------------------------------------------------------------

    def load(self, doc: dict) -> None:
        shape, nodes, fleet = parse_profile(doc)
        order = {n: i for i, n in enumerate(nodes)}
        devices = sorted(fleet.devices, key=lambda d: (d.node != fleet.coordinator, order.get(d.node, len(order))))
        self.beginResetModel()
        self.shape, self.nodes, self.fleet = shape, nodes, fleet
        self.lanes = [Lane(d.node, d.device, str(nodes.get(d.node, {}).get("name", d.node)),
                           str(nodes.get(d.node, {}).get("address", LOCAL)), int(d.memory_bytes),
                           bool(nodes.get(d.node, {}).get("simulated"))) for d in devices]
        self.stages = self._even_split()
        self.endResetModel()
        self.evaluate()

    def _even_split(self) -> list[StageRange]:
        """A starting plan: the layers split evenly over the nodes (each node's first supported device)."""
        first: dict[str, int] = {}
        for i, lane in enumerate(self.lanes):
            profile = self.fleet.device(lane.node, lane.device)
            if lane.node not in first and (profile is None or profile.supported):
                first[lane.node] = i
        total = self.shape.num_layers
        if total < 1:
            return []
        lanes = list(first.values())[:total] or [0]
        return [StageRange(lane, a, b) for lane, (a, b) in zip(lanes, plan_split(total, len(lanes)))]

    @property
    def loaded(self) -> bool:
        return self.shape is not None

    def lane_of(self, node: str, device: str) -> int | None:
        return next((i for i, lane in enumerate(self.lanes) if (lane.node, lane.device) == (node, device)), None)

    # --- editing -------------------------------------------------------------------------------------

    def set_stages(self, stages: list[StageRange], ranks: bool = False) -> None:
        self.beginResetModel()
        self.stages = sorted(stages, key=lambda s: s.start)
        self.ranks = ranks
        self.endResetModel()
        self.evaluate()

    def set_plan(self, plan, pins=()) -> None:
        """The stages of a solver ``Plan``; ranges equal to a pin stay pinned."""
        pinned = {(p.node, p.start, p.end) for p in pins}
        stages = []
        for s in plan.stages:
            lane = self.lane_of(s.node, s.device)
            if lane is None:
                raise FleetError(f"the plan uses {s.device} of node {s.node}, which is not in the profile")
            stages.append(StageRange(lane, s.start, s.end, (s.node, s.start, s.end) in pinned))
        self.set_stages(stages, ranks=bool(getattr(plan, "ranks", False)))

    def move_range(self, start: int, end: int, lane: int) -> bool:
        """Moves layers ``start``-``end`` onto ``lane``: they leave the stages that held them, and a
        neighbouring range already on that lane joins them.  A whole range keeps its pin."""
        if not self.loaded or not (0 <= start < end <= self.shape.num_layers) or not 0 <= lane < len(self.lanes):
            return False
        if self.ranks:  # a range moved by hand makes a chain again, from rank 0's whole model here
            self.stages, self.ranks = self.stages[:1], False
        whole = next((s for s in self.stages if (s.start, s.end) == (start, end)), None)
        if whole is not None and whole.lane == lane:
            return False
        pieces = []
        for s in self.stages:
            if s.end <= start or s.start >= end:
                pieces.append(s)
                continue
            if s.start < start:
                pieces.append(StageRange(s.lane, s.start, start))
            if s.end > end:
                pieces.append(StageRange(s.lane, end, s.end))
        moved = StageRange(lane, start, end, whole.pinned if whole else False)
        pieces.append(moved)
        pieces.sort(key=lambda s: s.start)
        merged: list[StageRange] = []
        for s in pieces:
            prev = merged[-1] if merged else None
            if prev is not None and prev.lane == s.lane and prev.end == s.start and (prev is moved or s is moved):
                moved = merged[-1] = StageRange(s.lane, prev.start, s.end)
            else:
                merged.append(s)
        self.set_stages(merged)
        return True

    def move_boundary(self, index: int, layer: int) -> bool:
        """Moves the boundary after stage ``index`` to ``layer`` (each side keeps at least one layer)."""
        if self.ranks or not 0 <= index < len(self.stages) - 1:  # ranks have no boundaries between them
            return False
        left, right = self.stages[index], self.stages[index + 1]
        layer = max(left.start + 1, min(right.end - 1, int(layer)))
        if layer == left.end:
            return False
        left.end = right.start = layer
        first, last = self.range_index(index), self.range_index(index + 1)
        self.dataChanged.emit(first, first.siblingAtColumn(1))
        self.dataChanged.emit(last, last.siblingAtColumn(1))
        self.evaluate()
        return True

    def split(self, index: int) -> bool:
        """Splits a range of 2+ layers in two halves on the same lane."""
        s = self.stages[index]
        if self.ranks or s.end - s.start < 2:
            return False
        mid = (s.start + s.end) // 2
        rest = [x for i, x in enumerate(self.stages) if i != index]
        self.set_stages(rest + [StageRange(s.lane, s.start, mid), StageRange(s.lane, mid, s.end)])
        return True

    def set_pinned(self, index: int, pinned: bool) -> None:
        self.stages[index].pinned = pinned
        at = self.range_index(index)
        self.dataChanged.emit(at, at.siblingAtColumn(1), [Qt.ItemDataRole.CheckStateRole])
        self.planChanged.emit()

    def set_users(self, users: int) -> None:
        self.users = max(1, int(users))
        self.evaluate()

    def pins(self) -> list:
        return [Pin(node=self.lanes[s.lane].node, start=s.start, end=s.end, device=self.lanes[s.lane].device)
                for s in self.stages if s.pinned]

    def chain(self) -> list[tuple[str, str, int, int]]:
        return [(self.lanes[s.lane].node, self.lanes[s.lane].device, s.start, s.end) for s in self.stages]

    def placement(self) -> list[StageSpan]:
        """The plan as ``deploy`` takes it: each stage at its lane's agent, ``LOCAL`` for this app's
        lane (a plan whose stage 0 is on another PC is fed from here)."""
        return [StageSpan(self.lanes[s.lane].address, self.lanes[s.lane].device, s.start, s.end,
                          rank=i if self.ranks else None) for i, s in enumerate(self.stages)]

    def placement_of(self, plan) -> list[StageSpan]:
        """A solver ``Plan`` (another copy of the model, not the one drawn) as ``deploy`` takes it."""
        address = {lane.node: lane.address for lane in self.lanes}
        return [s.at(address[s.node]) for s in plan.stages]

    # --- pricing -------------------------------------------------------------------------------------

    def evaluate(self) -> None:
        if not self.loaded:
            return
        chain = self.chain()
        fed = bool(chain) and chain[0][0] != self.fleet.coordinator  # this app feeds a chain on other PCs
        if self.ranks:
            self.evaluation = price_ranks(self.shape, self.fleet, [(node, device) for node, device, _, _ in chain],
                                          users=self.users)
        else:
            self.evaluation = evaluate(self.shape, self.fleet, chain, users=self.users, fed=fed)
        problems = list(self.evaluation.problems)
        refused = placement_problem(self.placement())  # what deploy() refuses besides what evaluate prices
        if refused is not None:
            problems.append(refused)
        self.problems = [self.readable(p) for p in problems]
        if self.stages:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self.lanes) - 1, 1))
        self.planChanged.emit()

    def readable(self, text: str) -> str:
        return survey.readable(text, self.nodes)

    def stage_ms(self, index: int) -> float:
        return self.evaluation.plan.stages[index].ms if self.evaluation else 0.0

    def lane_memory(self, lane: int) -> int:
        if not self.evaluation:
            return 0
        return sum(p.memory_bytes for s, p in zip(self.stages, self.evaluation.plan.stages) if s.lane == lane)

    # --- Qt's model -----------------------------------------------------------------------------------

    def _children(self, lane: int) -> list[int]:
        return [i for i, s in enumerate(self.stages) if s.lane == lane]

    def lane_index(self, lane: int, column: int = 0) -> QModelIndex:
        return self.createIndex(lane, column, 0)

    def range_index(self, stage: int, column: int = 0) -> QModelIndex:
        lane = self.stages[stage].lane
        return self.createIndex(self._children(lane).index(stage), column, lane + 1)

    def stage_of(self, index: QModelIndex) -> int | None:
        if not index.isValid() or index.internalId() == 0:
            return None
        children = self._children(index.internalId() - 1)
        return children[index.row()] if index.row() < len(children) else None

    def index(self, row: int, column: int, parent=QModelIndex()) -> QModelIndex:
        if column < 0 or column >= len(self.COLUMNS) or row < 0:
            return QModelIndex()
        if not parent.isValid():
            return self.createIndex(row, column, 0) if row < len(self.lanes) else QModelIndex()
        if parent.internalId() != 0:
            return QModelIndex()
        return self.createIndex(row, column, parent.row() + 1) if row < len(self._children(parent.row())) \
            else QModelIndex()

    def parent(self, index=QModelIndex()) -> QModelIndex:
        if not index.isValid() or index.internalId() == 0:
            return QModelIndex()
        return self.createIndex(index.internalId() - 1, 0, 0)

    def rowCount(self, parent=QModelIndex()) -> int:
        if not parent.isValid():
            return len(self.lanes)
        if parent.internalId() == 0 and parent.column() == 0:
            return len(self._children(parent.row()))
        return 0

    def columnCount(self, parent=QModelIndex()) -> int:
        return len(self.COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.COLUMNS[section]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        stage = self.stage_of(index)
        if stage is None:
            lane = self.lanes[index.row()]
            if role == Qt.ItemDataRole.DisplayRole:
                return lane.label if index.column() == 0 else \
                    f"{self.lane_memory(index.row()) / GB:.2f} of {lane.memory_bytes / GB:.1f} GB"
            if role == Qt.ItemDataRole.ToolTipRole:
                return plain_tip(f"{lane.name} ({lane.address}), {lane.device}: drop layer ranges here")
            return None
        s = self.stages[stage]
        if role == Qt.ItemDataRole.DisplayRole:
            return layer_span(s.start, s.end) if index.column() == 0 else \
                f"{'rank' if self.ranks else 'stage'} {stage}, {self.stage_ms(stage):.2f} ms"
        if role == Qt.ItemDataRole.CheckStateRole and index.column() == 0:
            return Qt.CheckState.Checked if s.pinned else Qt.CheckState.Unchecked
        if role == Qt.ItemDataRole.ToolTipRole:
            return "checked: pinned (Optimise keeps this range on this device)"
        return None

    def setData(self, index, value, role=Qt.ItemDataRole.EditRole) -> bool:
        stage = self.stage_of(index)
        if stage is None or role != Qt.ItemDataRole.CheckStateRole:
            return False
        checked = Qt.CheckState.Checked
        self.set_pinned(stage, value in (checked, checked.value))
        return True

    def flags(self, index):
        base = Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable
        if not index.isValid():
            return Qt.ItemFlag.NoItemFlags
        if self.stage_of(index) is None:
            return base | Qt.ItemFlag.ItemIsDropEnabled
        return base | Qt.ItemFlag.ItemIsDragEnabled | Qt.ItemFlag.ItemIsUserCheckable | Qt.ItemFlag.ItemIsDropEnabled

    def supportedDropActions(self):
        return Qt.DropAction.MoveAction

    def supportedDragActions(self):
        return Qt.DropAction.MoveAction

    def mimeTypes(self) -> list[str]:
        return [MIME]

    def mimeData(self, indexes) -> QMimeData:
        """The first layer range among ``indexes``, as ``{"start", "end"}``."""
        mime = QMimeData()
        for index in indexes:
            stage = self.stage_of(index)
            if stage is not None:
                s = self.stages[stage]
                mime.setData(MIME, json.dumps({"start": s.start, "end": s.end}).encode())
                break
        return mime

    def canDropMimeData(self, data, action, row, column, parent) -> bool:
        return data.hasFormat(MIME) and parent.isValid()

    def dropMimeData(self, data, action, row, column, parent) -> bool:
        """Moves the layer range in ``data`` onto the lane ``parent`` is (or holds it)."""
        if not data.hasFormat(MIME) or not parent.isValid() or action == Qt.DropAction.IgnoreAction:
            return False
        lane = parent.row() if parent.internalId() == 0 else parent.internalId() - 1
        try:
            doc = json.loads(bytes(data.data(MIME)).decode())
            start, end = int(doc["start"]), int(doc["end"])
        except (ValueError, KeyError, TypeError):
            return False
        return self.move_range(start, end, lane)
