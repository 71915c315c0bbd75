"""What is running, in one place: the fleet deployment, the chain the chat uses, the API server and
the nodes.  Every view and the status bar read it, so they tell the same story.

Each fact is fed by what owns it (the main window wires them): the Placement view's deploy gives
the deployment, the chat controller's connection signals the chat's chain and its state, the API
controller's status the server, and the Fleet view's polling the nodes and what each one serves.
``changed`` is emitted whenever any of them changes; the properties are read-only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from engine.config import paths
from engine.errors import FleetError
from engine.fleet.deploy import LOCAL, Deployment
from engine.manifest import layer_span, read_manifest
from engine.models.catalog import CATALOG, is_cached

# what the chat's chain is doing
NOT_STARTED, STARTING, CONNECTED, FAILED = "not started", "starting", "connected", "failed"
# what a deployment the chat runs on is doing, as every view words it (``Running.deployment_state``)
DEPLOYMENT_STATES = {NOT_STARTED: "deployed", STARTING: "starting", CONNECTED: "running", FAILED: "did not start"}
ON_DEPLOYMENT = "deployment:"  # the model pickers' entry of the fleet deployment the chat runs on


@dataclasses.dataclass(frozen=True)
class Node:
    """A node as the Fleet view last saw it: this PC, a worker on it, or another PC."""

    name: str
    address: str  # its agent's HOST:PORT ("" for this PC itself)
    answering: bool
    serving: tuple[str, ...] = ()  # what it runs now, in words ("serving stage 1 (layers 2-3)")


@dataclasses.dataclass(frozen=True)
class Chat:
    """The chain the chat uses: the settings' model on this PC, or a fleet deployment."""

    model: str = ""
    deployment: Deployment | None = None
    state: str = NOT_STARTED
    detail: str = ""  # connected: the chain's description; starting: the step; failed: why

    @property
    def where(self) -> str:
        return "on the fleet" if self.deployment is not None else "on this PC"


class Running(QObject):
    changed = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._deployment: Deployment | None = None
        self._chat = Chat()
        self._api_url = ""
        self._api_text = "API: off"
        self._nodes: tuple[Node, ...] = ()

    # --- what views read -----------------------------------------------------------------------------

    @property
    def deployment(self) -> Deployment | None:
        """The fleet deployment this app runs or uses (None: none)."""
        return self._deployment

    @property
    def chat(self) -> Chat:
        return self._chat

    @property
    def api_running(self) -> bool:
        return bool(self._api_url)

    @property
    def api_url(self) -> str:
        return self._api_url

    @property
    def api_text(self) -> str:
        """The API server's line: what it serves and where, or why it does not."""
        return self._api_text

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._nodes

    def chat_text(self) -> str:
        """The chat's line for the status bar."""
        chat = self._chat
        name = model_name(chat.deployment.model if chat.deployment is not None else chat.model)
        if chat.state == CONNECTED:  # the chain's own words, its model named as the pickers name it
            model, comma, rest = chat.detail.partition(", ")
            return f"Chat: {model_name(model)}{comma}{rest}"
        if chat.state == STARTING:
            return f"Chat: {name} {chat.where}, starting" + (f": {chat.detail}…" if chat.detail else "…")
        if chat.state == FAILED:
            return f"Chat: {name} {chat.where} did not start"
        return f"Chat: {name} {chat.where}, not started yet" if name else "Chat: no model chosen"

    def deployment_state(self, deployment: Deployment | None) -> str:
        """What ``deployment`` is doing in words (``DEPLOYMENT_STATES``), from the chat's chain when the
        chat runs on it: "starting" while that chain starts, "running" once it is connected, "did not
        start"; "" when the chat does not run on it.  The Placement view's parts say this while the
        status bar says the chat's line (``chat_text``), so the two never disagree."""
        if deployment is None or self._chat.deployment is not deployment:
            return ""
        return DEPLOYMENT_STATES[self._chat.state]

    def nodes_text(self) -> str:
        """The nodes' line: how many there are and how many answer."""
        if not self._nodes:
            return "1 node: this PC"
        up = sum(1 for n in self._nodes if n.answering)
        return f"{len(self._nodes)} node{'s' if len(self._nodes) != 1 else ''}, {up} answering"

    def deployment_parts(self) -> list[tuple[str, str]]:
        """(node name, layers) of each part of the deployment, in chain order."""
        if self._deployment is None:
            return []
        names = {n.address: n.name for n in self._nodes if n.address}
        return [("this PC" if s.node == LOCAL else names.get(s.node, s.node), layer_span(s.start, s.end))
                for s in self._deployment.placement]

    # --- what the owners of each fact feed -----------------------------------------------------------

    def set_deployment(self, deployment: Deployment | None) -> None:
        self._deployment = deployment
        self.changed.emit()

    def set_chat(self, model: str, deployment: Deployment | None, state: str, detail: str = "") -> None:
        chat = Chat(model, deployment, state, detail)
        if chat != self._chat:
            self._chat = chat
            self.changed.emit()

    def set_api(self, text: str, url: str = "") -> None:
        if (text, url) != (self._api_text, self._api_url):
            self._api_text, self._api_url = text, url
            self.changed.emit()

    def set_nodes(self, nodes: list[Node]) -> None:
        nodes = tuple(nodes)
        if nodes != self._nodes:
            self._nodes = nodes
            self.changed.emit()


def catalog_name(source: str) -> str:
    """The model's name: its catalog name where it is a catalog model (a shard folder's from its
    manifest), else a GGUF file's or folder's own name."""
    if source in CATALOG:
        return source
    path = Path(source)
    try:
        return read_manifest(path / "stage0").model_name if (path / "stage0").is_dir() else path.stem or source
    except (OSError, ValueError, KeyError, FleetError):
        return path.name or source


def model_name(source: str) -> str:
    """A model as people name it ("SmolLM2 135M"), from a catalog name, a shard folder (its
    manifest's model), a GGUF file or a Hugging Face folder."""
    name = catalog_name(source)
    entry = CATALOG.get(name)
    if entry is None:
        return name
    words = entry.description.split(":")[0].split()[0]  # "Qwen2.5-Coder-1.5B-Instruct"
    return words.removesuffix("-Instruct").replace("-", " ")


def folder_tip(source: str) -> str:
    """Where a model's files are, for a tooltip beside its name: a file's or folder's path; "" for a
    catalog model (its name says it all)."""
    return "" if not source or source in CATALOG else f"Files: {source}"


def pc_name(address: str, names: dict[str, str] | None = None) -> str:
    """A node's agent address as people name the PC: "this PC", its name in ``names`` (the nodes'
    names by address, as the Fleet view knows them), else its host."""
    if address == LOCAL:
        return "this PC"
    return (names or {}).get(address) or address.rsplit(":", 1)[0]


def nodes_of(deployment, names: dict[str, str] | None = None) -> str:
    """The PCs a deployment's chain runs on, in words: "this PC + laptop-2" (``pc_name``'s names)."""
    return " + ".join(dict.fromkeys(pc_name(span.node, names) for span in deployment.placement)) or "the fleet"


def deployment_where(deployment, names: dict[str, str] | None = None, standbys: bool = True) -> str:
    """Every PC a deployment runs on, in words: its chain's, each other copy's of the model and (with
    ``standbys``) the PCs keeping a part ready: "this PC + laptop-2, a copy on laptop-3, a standby on
    laptop-4"."""
    places = [nodes_of(deployment, names), *(f"a copy on {nodes_of(Deployment.from_json(r), names)}"
                                             for r in deployment.replicas)]
    spares = dict.fromkeys(pc_name(s.get("agent", ""), names) for s in deployment.standbys) if standbys else {}
    if spares:
        places.append(f"a standby on {' + '.join(spares)}" if len(spares) == 1 else
                      f"standbys on {' + '.join(spares)}")
    return ", ".join(places)


def complete_shard_sets() -> list[Path]:
    """The exported shard sets in the cache that hold every stage (newest first): a profile's
    intermediate shards (one stage of a split) are left out."""
    found = []
    try:
        folders = list(paths().shards.iterdir())
    except OSError:
        return []
    for folder in folders:
        try:
            count = read_manifest(folder / "stage0").stage_count
        except (OSError, ValueError, KeyError, FleetError):
            continue
        if all((folder / f"stage{i}").is_dir() for i in range(count)):
            found.append(folder)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def model_choices(current: str, deployment=None, names: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The models the picker offers, as (what it shows, the source it runs): the deployment the chat
    runs on, the current model, the models exported on this PC, then the catalog; by name and
    where they run ("Qwen2.5 Coder 1.5B — on this PC"), never by cache path."""
    choices: dict[str, str] = {}
    if deployment is not None:
        choices[ON_DEPLOYMENT] = f"{model_name(deployment.model)} — fleet: {deployment_where(deployment, names)}"
    exported = complete_shard_sets()
    by_model = {model_name(str(folder)): folder for folder in reversed(exported)}  # the newest of each model
    catalog = {model_name(name): name for name in CATALOG}
    for source in (current, *(str(f) for n, f in by_model.items() if n not in catalog), *CATALOG):
        if not source or source in choices:
            continue
        entry = CATALOG.get(source)
        here = entry is None or is_cached(entry) or model_name(source) in by_model
        where = "on this PC" if here else f"download ({entry.size / 1e6:.0f} MB)"
        choices[source] = f"{model_name(source)} — {where}"
    return [(label, source) for source, label in choices.items()]
