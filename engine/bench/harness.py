"""What the fleet benchmarks share: a loopback pipeline with injected hop delay, draft models per
stream, and decoding a set of prompts as concurrent streams with aggregate throughput.

Every stage beyond the first runs in its own ``fleet worker`` process, as on a real fleet; with
``cpu_sets`` (``"0-1;2-3"``) each stage, the coordinator included, is pinned to its own cores.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.fleetkey import create_key, load_key
from engine.runtime.affinity import parse_cpu_sets, pin
from engine.runtime.chain import LocalChain
from engine.runtime.generate import Generation, generate_streams
from engine.runtime.localfleet import LocalFleet
from engine.runtime.remote import RemoteChain
from engine.runtime.speculative import DraftModel, Hybrid, PromptLookup, check_draft_tokenizer
from engine.runtime.stage import compile_config


@contextlib.contextmanager
def loopback(folders: list[Path], *, delay_ms: float = 0.0, mode: str = "fast", isolate: bool = False,
             cpu_sets: str = ""):
    """Yields (RemoteChain, LocalFleet): worker processes serve ``folders[1:]``, stage 0 runs here."""
    sets = parse_cpu_sets(cpu_sets, len(folders))
    pin(sets[0])
    with tempfile.TemporaryDirectory() as tmp:
        key_path = create_key(Path(tmp) / "bench.key")
        with LocalFleet(folders[1:], key_path, delay_ms=delay_ms, mode=mode, isolate=isolate,
                        cpu_sets=sets[1:], log_dir=Path(tmp)) as fleet:
            chain = RemoteChain(folders[0], fleet.addresses, key=load_key(key_path), mode=mode, isolate=isolate)
            try:
                yield chain, fleet
            finally:
                chain.close()


def drafters(kind: str, target, draft_folders: list[Path] | None, streams: int, mode: str = "fast"):
    """``streams`` drafters of one kind: ``none``, ``lookup``, ``model`` or ``hybrid``."""
    if kind == "none":
        return None
    if kind == "lookup":
        return [PromptLookup() for _ in range(streams)]
    draft_chain = LocalChain(draft_folders, config=compile_config(mode))
    check_draft_tokenizer(target.manifest, draft_chain.manifest, draft_folders[0])
    models = [DraftModel(draft_chain, stream=i) for i in range(streams)]
    return [Hybrid(PromptLookup(), m) for m in models] if kind == "hybrid" else models


@dataclass
class BatchRun:
    results: list[Generation]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tok_s(self) -> float:
        """Aggregate throughput: every stream's tokens over the batch's wall time (prefill included)."""
        return self.tokens / self.wall_s

    @property
    def acceptance(self) -> float:
        drafted = sum(r.drafted for r in self.results)
        return sum(r.accepted for r in self.results) / drafted if drafted else 0.0

    @property
    def mean_k(self) -> float:
        ks = [k for r in self.results for k in r.k_history]
        return sum(ks) / len(ks) if ks else 0.0

    def breakdown(self) -> dict:
        """Per-token compute (all stages plus the coordinator's own work) and waiting, stream 0."""
        bd = self.results[0].breakdown.to_json()
        compute = sum(bd["stage_compute_ms"]) + bd["host_ms"] + bd["draft_ms"]
        return {"token_ms": bd["token_ms"], "compute_ms": compute, "network_ms": bd["network_ms"]}


def run_batch(chain, prompts, tokens: int, *, drafters_=None, k="auto") -> BatchRun:
    length = max(p.shape[-1] for p in prompts) + tokens + 16
    results, wall = generate_streams(chain, prompts, tokens, max_length=length, ignore_eos=True,
                                     drafters=drafters_, k=k)
    return BatchRun(results, wall)


def warm_up(chain, prompts, drafters_=None) -> None:
    """First inferences (and, with per-stream compiled models, first compiles) are slow: run every
    stream a few tokens, with and without drafting, before anything is measured."""
    run_batch(chain, prompts, 4)
    if drafters_:
        run_batch(chain, prompts, 4, drafters_=drafters_[: len(prompts)], k=3)
