"""Measuring a fleet for the placement solver: every device's profile and every round trip.

``survey`` profiles this machine (the coordinator) directly and each node through its agent: it
ships the model's profiling shards (``engine.fleet.profile``), has the node run them on each of its
devices, and asks every node for its round trip to the others.  The result is one JSON document,
``{"model": ModelShape, "nodes": {id: {"name", "address"}}, "fleet": Fleet, "source", "weights",
"taken"}``, that ``fleet place`` and the app's placement view hand to ``engine.fleet.placement``;
``"taken"`` records what was asked and when, so ``recent_survey`` can reuse the document.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.config import DEFAULT_WEIGHTS, FleetAccess
from engine.errors import FleetError
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.deploy import LOCAL
from engine.fleet.placement import DeviceProfile, Fleet, ModelShape
from engine.fleet.profile import export_profile_shards, model_shape, profile_shards
from engine.manifest import load_manifest
from engine.progress import Progress, Report, quiet

FRESH_S = 24 * 3600  # how long `fleet up --nodes` reuses a survey of the same fleet
HERE = "this PC"  # the coordinator's name among a survey's nodes, as the app and the CLI show it
FORMER_HERE = ("this machine",)  # what older surveys and plans call the coordinator: read as HERE


def device_profile(node: str, measured: dict) -> DeviceProfile:
    return DeviceProfile(node=node, device=measured["device"], memory_bytes=int(measured["memory_bytes"]),
                         layer_ms=measured["layer_ms"], head_ms=measured["head_ms"], embed_ms=measured["embed_ms"],
                         prefill_layer_ms=measured["prefill_layer_ms"], supported=bool(measured["supported"]),
                         call_ms=measured["call_ms"])


def node_devices(status: dict) -> list[str]:
    names = [d.get("name") for d in status.get("node", {}).get("devices", []) if isinstance(d, dict)]
    return [n for n in names if isinstance(n, str) and n] or ["CPU"]


def survey(model: str, agents: list[str], *, access: FleetAccess, local_node: str, local_devices=("CPU",),
           weights: str = DEFAULT_WEIGHTS, context: int = 4096, streams: int = 1, progress: Report = quiet,
           cancel=None) -> dict:
    """Profiles this machine and the agents at ``agents`` (HOST:PORT each, reached with ``access``) for
    ``model``; ``progress`` tells each node's steps.  ``cancel.is_set()`` stops it between steps (and
    shard chunks) with a FleetError."""

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise FleetError("fleet profile cancelled")

    statuses = {}  # every agent asked first: one that does not answer fails the survey before any work
    for address in agents:
        check()
        try:
            with ControlClient(address, access, timeout_s=30) as agent:
                statuses[address] = agent.status()
        except AgentError as exc:
            raise FleetError(f"survey of the node at {address} failed: {exc}") from None
    folders = export_profile_shards(model, weights, cancel=cancel)
    shape = ModelShape(**model_shape(load_manifest(folders[0]), context, streams))
    devices: list[DeviceProfile] = []
    of = f"of {1 + len(statuses)}"  # the machines to profile: this one, then each node (in the progress lines)
    for device in local_devices:
        check()
        progress(Progress(f"Node 1 {of}: profiling {HERE}'s {device}"))
        devices.append(device_profile(local_node, profile_shards(folders, device)))
    nodes = {local_node: {"name": HERE, "address": LOCAL}}
    rtt: dict[tuple[str, str], float] = {}
    ids: dict[str, str] = {}  # the agents profiled, by address
    answered = {address: status["node"]["node_id"] for address, status in statuses.items()}
    for number, (address, status) in enumerate(statuses.items(), 2):
        node = answered[address]
        if node in nodes:  # this machine's own agent (a tray worker), or a node under two addresses
            progress(Progress(f"Node {number} {of}: the node agent at {address} is {nodes[node]['name']}, "
                              "already profiled: skipped"))
            continue
        ids[address] = node
        nodes[node] = {"name": status["node"].get("name", address), "address": address,
                       **({"simulated": True} if status["node"].get("simulated") else {})}
        check()
        try:
            with ControlClient(address, access, timeout_s=30) as agent:
                rtt[(local_node, node)] = agent.round_trip_ms()
                digests = []
                for i, folder in enumerate(folders):
                    progress(Progress(f"Node {number} {of}: sending profiling shard {i + 1}/{len(folders)} to "
                                      f"{nodes[node]['name']}"))
                    digests.append(agent.send_shard(folder, cancel=cancel)[0])
                for device in node_devices(status):
                    check()
                    progress(Progress(f"Node {number} {of}: profiling {nodes[node]['name']}'s {device}"))
                    measured = agent.call("profile", timeout_s=600, hashes=digests, device=device)
                    devices.append(device_profile(node, measured))
        except AgentError as exc:
            raise FleetError(f"survey of the node at {address} failed: {exc}") from None
    for address, node in ids.items():
        peers = [a for a in ids if a != address]
        if not peers:
            continue
        with ControlClient(address, access, timeout_s=60) as agent:
            measured = agent.call("rtt", timeout_s=120, peers=peers)["rtt_ms"]
        for peer, ms in measured.items():
            if ms is None:
                raise FleetError(f"node {nodes[node]['name']} cannot reach the node at {peer}")
            pair = tuple(sorted((node, ids[peer])))
            rtt[pair] = max(rtt.get(pair, 0.0), float(ms))  # each direction measured: keep the slower
    fleet = Fleet(devices=devices, rtt_ms=rtt, coordinator=local_node)
    taken = {"devices": list(local_devices), "context": context, "streams": streams, "agents": answered,
             "at": time.time()}
    return {"model": shape.to_json(), "nodes": nodes, "fleet": fleet.to_json(), "source": model,
            "weights": weights, "taken": taken}


def current_names(nodes: dict) -> dict:
    """A survey's (or plan's) ``nodes`` with the coordinator named ``HERE`` where an older document
    gave it a former name: the names the app and the CLI show, and the ones ``--pin`` matches."""
    if not isinstance(nodes, dict):
        return nodes
    return {node: {**info, "name": HERE} if isinstance(info, dict) and info.get("address") == LOCAL
            and info.get("name") in FORMER_HERE else info for node, info in nodes.items()}


def read_names(doc: dict) -> dict:
    """``doc`` (a survey or plan document, as saved) with its nodes' names as ``current_names`` gives them."""
    if isinstance(doc, dict) and isinstance(doc.get("nodes"), dict):
        return {**doc, "nodes": current_names(doc["nodes"])}
    return doc


def recent_survey(path: Path, model: str, agents: list[str], *, access: FleetAccess, local_node: str,
                  local_devices=("CPU",), weights: str = DEFAULT_WEIGHTS, context: int = 4096, streams: int = 1,
                  max_age_s: float = FRESH_S) -> dict | None:
    """The survey document at ``path`` if ``survey`` would take the same one now: the same model,
    weights, context, streams and devices of this machine, less than ``max_age_s`` old, and the same
    agents, each still answering as the node it was.  Otherwise None."""
    try:
        doc = json.loads(Path(path).read_text())
        taken = doc["taken"]
        same = (doc["source"], doc["weights"], taken["devices"], taken["context"], taken["streams"],
                sorted(taken["agents"]), doc["fleet"]["coordinator"]) == \
               (model, weights, list(local_devices), context, streams, sorted(set(agents)), local_node)
        if not same or not 0 <= time.time() - float(taken["at"]) < max_age_s:
            return None
        for address, node in taken["agents"].items():
            with ControlClient(address, access, timeout_s=10) as agent:
                if agent.status()["node"]["node_id"] != node:
                    return None
    except (OSError, ValueError, KeyError, TypeError, AgentError):
        return None
    return read_names(doc)


def readable(text: str, nodes: dict) -> str:
    """``text`` with the profile's node ids replaced by the nodes' names: the engine names nodes by
    id, a person knows them by name."""
    for node, info in nodes.items():
        text = text.replace(node, str(info.get("name", node)))
    return text


def load_survey(path: Path) -> tuple[ModelShape, dict, Fleet]:
    try:
        raw = json.loads(Path(path).read_text())
        return ModelShape.from_json(raw["model"]), current_names(raw["nodes"]), Fleet.from_json(raw["fleet"])
    except FileNotFoundError:
        raise FleetError(f"no fleet profile at {path}: make one with `fleet profile --nodes all` "
                         f"(or HOST:PORT,...)") from None
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise FleetError(f"{path} is not a fleet profile written by `fleet profile` ({exc})") from None
