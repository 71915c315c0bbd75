"""Whether a model fits this PC and the fleet, and how fast it would run there: the figures on a model card.

``predict`` takes a model's card facts (``engine.models.facts``) and the last fleet profile
(``engine.fleet.survey``'s document in ``fleet-profile.json``) and answers with a ``Fit``: the memory
the whole model needs, whether this PC (the coordinator) holds it, the fewest of the fleet's PCs
whose memory holds it, and the predicted tok/s for one user (``placement.solve``, objective
latency) and for four (``layout.solve_layout``).  A card must work before the model is exported, so
the memory shape is estimated from the facts with the formula the profiler uses on a manifest
(``profile.model_shape``), unless the profile was taken of this very model.  The profile's timings
are of the profiled model; decode is memory-bound, so another model's per-layer (and head) times are
the profiled ones scaled by the ratio of bytes read.  Without a profile only the fit on this PC is
known, from the memory available now.

The last measured decode speed of each model (a chat reply's tok/s) is kept in
``measured-speed.json`` of the data folder, so a card can show it beside the prediction.
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
from pathlib import Path

import psutil

from engine.config import DEFAULT_WEIGHTS, paths
from engine.errors import ShardError
from engine.files import lock, write_json
from engine.fleet.layout import solve_layout
from engine.fleet.placement import DeviceProfile, Fleet, Infeasible, ModelShape, PlacementError, solve, stage_memory
from engine.fleet.profile import model_shape
from engine.manifest import MANIFEST, is_shard_set, load_manifest
from engine.models.catalog import CATALOG
from engine.models.facts import ModelFacts

PROFILE_NAME = "fleet-profile.json"
MEASURED_NAME = "measured-speed.json"
NO_PROFILE = "profile the fleet to predict speed"
USERS = 4  # the second speed a card shows: a small team sharing the model


@dataclasses.dataclass(frozen=True)
class Profile:
    """The parts of a fleet profile a prediction needs."""

    shape: ModelShape  # of the profiled model
    fleet: Fleet
    source: str  # the model argument it was profiled with (a catalog name, a path)
    weights: str
    context: int
    streams: int


@dataclasses.dataclass(frozen=True)
class Fit:
    model: str
    need_bytes: int  # the whole model in one stage: weights, KV cache, runtime overhead
    here_bytes: int  # the memory this PC has for it
    fits_here: bool
    fleet_pcs: int  # 0 without a profile
    pcs_needed: int | None  # the fewest PCs whose memory holds the model; None: the fleet does not
    tok_s_1: float | None  # predicted, one user
    tok_s_users: float | None  # predicted aggregate, USERS users
    note: str  # why a figure is missing ("profile the fleet to predict speed", the solver's reason)
    estimated_shape: bool  # the memory shape was estimated from the card facts, not a profiled export


def load_profile(path: Path | None = None) -> Profile | None:
    """The fleet profile at ``path`` (default: the data folder's), or None where there is none or it
    is not one."""
    path = Path(path) if path else paths().data / PROFILE_NAME
    try:
        doc = json.loads(path.read_text())
        taken = doc.get("taken", {})
        return Profile(shape=ModelShape.from_json(doc["model"]), fleet=Fleet.from_json(doc["fleet"]),
                       source=str(doc.get("source", "")), weights=str(doc.get("weights", "int4")),
                       context=int(taken.get("context", 4096)), streams=int(taken.get("streams", 1)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def estimate_shape(facts: ModelFacts, weights: str = DEFAULT_WEIGHTS, context: int = 4096,
                   streams: int = 1) -> ModelShape:
    """The memory shape an export of the model in ``weights`` would have, from its card facts."""
    if not facts.has_shape:
        raise PlacementError(f"{facts.name}: its layers, hidden size, heads and vocabulary are not known")
    spec = types.SimpleNamespace(
        hidden_size=facts.hidden_size, intermediate_size=facts.intermediate_size, num_heads=facts.num_heads,
        num_kv_heads=facts.num_kv_heads or facts.num_heads,
        head_dim=facts.head_dim or facts.hidden_size // facts.num_heads, vocab_size=facts.vocab_size,
        num_layers=facts.num_layers, max_position=facts.context or context)
    return ModelShape(**model_shape(types.SimpleNamespace(spec=spec, model_name=facts.name, weights=weights),
                                    context, streams))


def scaled_fleet(fleet: Fleet, profiled: ModelShape, target: ModelShape) -> Fleet:
    """The fleet's devices with their timings moved from the profiled model to ``target``: per-layer
    times by the ratio of layer bytes, the head and embedding by the ratio of head bytes (decode
    reads every weight once a token).  Memory and fixed call costs stay."""
    layer = target.layer_bytes / profiled.layer_bytes if profiled.layer_bytes else 1.0
    head = target.head_bytes / profiled.head_bytes if profiled.head_bytes else 1.0

    def scale(d: DeviceProfile) -> DeviceProfile:
        return dataclasses.replace(d, layer_ms=d.layer_ms * layer, prefill_layer_ms=d.prefill_layer_ms * layer,
                                   head_ms=d.head_ms * head, embed_ms=d.embed_ms * head)

    return Fleet(devices=[scale(d) for d in fleet.devices], rtt_ms=fleet.rtt_ms, coordinator=fleet.coordinator)


def node_memory(fleet: Fleet) -> dict[str, int]:
    """Each node's largest supported device's memory (a node runs one stage)."""
    out: dict[str, int] = {}
    for d in fleet.devices:
        if d.supported:
            out[d.node] = max(out.get(d.node, 0), d.memory_bytes)
    return out


def pcs_needed(model: ModelShape, fleet: Fleet) -> int | None:
    """The fewest PCs whose memory holds the model: the coordinator (it runs stage 0) and then the
    largest others, each paying a stage's overhead; None when the whole fleet does not."""
    memory = node_memory(fleet)
    need = stage_memory(model).at(model.num_layers, True, True) - model.overhead_bytes
    c = fleet.coordinator
    order = ([c] if c in memory else []) + sorted((n for n in memory if n != c), key=memory.get, reverse=True)
    held = 0
    for count, node in enumerate(order, 1):
        held += max(memory[node] - model.overhead_bytes, 0)
        if held >= need:
            return count
    return None


def predict(facts: ModelFacts, profile: Profile | None = None, *, weights: str = DEFAULT_WEIGHTS,
            available_bytes: int | None = None) -> Fit:
    """The card's figures for ``facts`` over ``profile`` (see the module's docstring).  Without a
    profile, ``available_bytes`` (default: the memory available now) is this PC's memory."""
    if profile is not None and profile.source in (facts.source, facts.name):
        shape, estimated = dataclasses.replace(profile.shape, name=facts.name), False
    else:
        context, streams = (profile.context, profile.streams) if profile else (4096, 1)
        shape = estimate_shape(facts, profile.weights if profile else weights, context, streams)
        estimated = True
    need = int(stage_memory(shape).at(shape.num_layers, True, True))
    if profile is None:
        if available_bytes is None:
            available_bytes = int(psutil.virtual_memory().available)
        return Fit(facts.name, need, available_bytes, need <= available_bytes, 0, None, None, None, NO_PROFILE,
                   estimated)
    fleet = scaled_fleet(profile.fleet, profile.shape, shape)
    memory = node_memory(fleet)
    here = memory.get(fleet.coordinator, 0)
    tok_1 = tok_n = None
    note = ""
    try:
        tok_1 = solve(shape, fleet, objective="latency", time_limit_s=10).tok_s
        tok_n = solve_layout(shape, fleet, users=USERS, time_limit_s=10).aggregate_tok_s
    except (Infeasible, PlacementError) as exc:
        note = str(exc)
    return Fit(facts.name, need, here, need <= here, len(memory), pcs_needed(shape, fleet), tok_1, tok_n, note,
               estimated)


# --- measured speeds ------------------------------------------------------------------------------------

def _measured_path() -> Path:
    return paths().data / MEASURED_NAME


def measured_key(source: str, deployed_as: str = "") -> str:
    """The name a measured speed is kept under: an export of a catalog model counts as that model (its
    manifest's fingerprint is the model's sha256), anything else is known by its path.  ``deployed_as``:
    ``source`` is a deployment's first stage, and the deployment's model name (``Deployment.model``)
    stands for it unless it is an export of a catalog model (what the chat records, the Placement view
    reads)."""
    if deployed_as:
        key = measured_key(source)
        return deployed_as if key == source else key
    if source in CATALOG or not is_shard_set(source):
        return source
    path = Path(source).expanduser()
    try:
        fingerprint = load_manifest(path if (path / MANIFEST).exists() else sorted(path.glob("stage*"))[0]).fingerprint
    except (ShardError, IndexError, OSError):
        return source
    return next((e.name for e in CATALOG.values() if e.sha256 == fingerprint), source)


def measured_speeds() -> dict[str, dict]:
    try:
        raw = json.loads(_measured_path().read_text())
        return raw if isinstance(raw, dict) else {}
    except (OSError, ValueError):
        return {}


def record_measured(model: str, tok_s: float) -> None:
    """Keeps ``tok_s`` as the last measured decode speed of ``model`` (a catalog name or a path)."""
    if not model or not tok_s > 0:
        return
    with lock(_measured_path()):  # another process may record its speed meanwhile
        speeds = measured_speeds()
        speeds[model] = {"decode_tok_s": round(float(tok_s), 2), "at": time.time()}
        write_json(_measured_path(), speeds, indent=1)


def measured_tok_s(model: str) -> float | None:
    value = measured_speeds().get(model, {})
    return value.get("decode_tok_s") if isinstance(value, dict) else None
