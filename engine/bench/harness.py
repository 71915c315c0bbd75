"""What the benchmarks share: the prompt set, a loopback pipeline with injected hop delay (opened as
``session.open_chain`` opens local workers), draft models per stream, decoding a set of prompts as
concurrent streams with aggregate throughput, configurations that take turns round by round
(``interleave``), a process's resident memory, and OpenVINO GenAI's LLMPipeline as the reference.

Every stage beyond the first runs in its own ``fleet worker`` process, as on a real fleet; with
``cpu_sets`` (``"0-1;2-3"``) each stage, the coordinator included, is pinned to its own cores.

A caller that wants to follow a benchmark (the desktop app) passes ``Hooks``: progress, every
generated token, every result row as soon as it is measured, and a cancel flag checked at every
decode round.  The command line passes none and sees no difference.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import numpy as np
import openvino as ov
import openvino_genai
import psutil

from engine.config import Scheduling, Settings
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.fleetkey import create_key
from engine.manifest import expand_shard_dirs
from engine.progress import Progress, Report
from engine.runtime.decode.generate import Generation, generate_streams
from engine.runtime.decode.speculative import draft_format
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.relay.affinity import parse_cpu_sets, pin
from engine.session import Launch, drafter_factory, open_chain

K, T = TypeVar("K"), TypeVar("T")

# The single-stream benchmarks' prompt (parity, pipeline).
STORY_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

# Eight categories; the speculation benchmark runs all of them, the others a named few.
PROMPTS = {
    "short factual": "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
    "reasoning": "A train leaves at 3 pm going 60 km/h; another leaves the same station at 4 pm going 90 km/h. "
                 "When does the second catch up? Explain step by step.",
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "list": "List ten common data structures and one typical use of each.",
    "creative": "Write a short poem about a lighthouse in a storm.",
    "technical explanation": "Explain how a hash map handles collisions.",
    "chat": "Hi! I'm planning a weekend trip to the mountains. Any tips?",
    "translation": "Translate into French: The meeting is moved to Thursday at ten, please bring the report.",
}


class BenchCancelled(FleetError):
    """The caller cancelled the benchmark."""


@dataclass
class Hooks:
    """How a caller follows and stops a benchmark."""

    progress: Report | None = None  # what runs now and the share of the run done
    on_token: Callable[[int, int], None] | None = None  # (stream, token) as each is generated
    on_row: Callable[[dict], None] | None = None  # each result row once measured
    cancel: object = None  # anything with is_set(): the benchmark stops at the next decode round

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise BenchCancelled("benchmark cancelled")

    def step(self, done: int, total: int, message: str) -> None:
        """Reports progress (``done`` of ``total`` units) and stops here if cancelled."""
        self.check()
        if self.progress:
            self.progress(Progress(message, min(done / total, 1.0) if total else 1.0))

    def row(self, row: dict) -> None:
        if self.on_row:
            self.on_row(row)

    def part(self, index: int, count: int) -> "Hooks":
        """These hooks for the ``index``-th of ``count`` equal parts of a run: the part's own
        progress, from 0 to 1, fills its share of the whole."""
        outer = self.progress
        return replace(self, progress=None if outer is None else
                       lambda p: outer(replace(p, fraction=(index + p.fraction) / count)))


NO_HOOKS = Hooks()


def split_export(model: str, stages: int, weights: str, shards=None, hooks: Hooks = NO_HOOKS):
    """The model's shard folders split into ``stages``, or the given ``shards`` (an export folder or
    stage folders) as they are."""
    if shards:
        return expand_shard_dirs(shards if isinstance(shards, (list, tuple)) else [shards])
    return export_model(model, stages=stages, weights=weights, cancel=hooks.cancel).folders


def prompt_ids(folder: Path, names) -> list[np.ndarray]:
    """The named prompts, chat-templated and tokenized with the shard's tokenizer."""
    tok = ChatTokenizer(folder)
    return [tok.prompt_ids(PROMPTS[name]) for name in names]


def draft_export(draft: str, kind: str, weights: str) -> list[Path] | None:
    """The draft model's 1-stage shard when ``kind`` needs a model."""
    if kind not in ("model", "hybrid"):
        return None
    return export_model(draft, stages=1, **draft_format(weights)).folders


@contextlib.contextmanager
def loopback(folders: list[Path], *, delay_ms: float = 0.0, mode: str = "fast", isolate: bool = False,
             cpu_sets: str = "", turns: bool = True, device: str = "CPU", tls: bool = True):
    """Yields (chain, LocalWorkers) as ``session.open_chain`` opens a shard set with local workers:
    stage 0 here, ``folders[1:]`` in worker processes on loopback under a throwaway fleet key, their
    logs in a temporary folder.  One folder is a whole model: it yields (LocalChain, None).
    ``cpu_sets``: one CPU set per stage, stage 0 this process; ``turns``: the workers take compute
    turns (``engine.runtime.stages.turns``); ``tls``: the workers and the chain speak TLS (a fleet's
    default)."""
    sets = parse_cpu_sets(cpu_sets, len(folders))
    pin(sets[0])
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(device=device, mode=mode, fleet_key_file=str(create_key(Path(tmp) / "bench.key")), tls=tls)
        launch = Launch(shards=list(folders), workers="processes" if len(folders) > 1 else "none", delay_ms=delay_ms,
                        isolate=isolate, cpu_sets=sets[1:], take_turns=turns, log_dir=Path(tmp))
        opened = open_chain(settings, launch)
        try:
            yield opened.chain, next(iter(opened.owned), None)
        finally:
            opened.close()


def drafters(kind: str, target, draft_folders: list[Path] | None, streams: int):
    """``streams`` drafters of one kind (``none``, ``lookup``, ``model`` or ``hybrid``), fast mode."""
    factory = drafter_factory(kind, target, draft_folders)
    return factory(streams) if factory else None


@dataclass
class DecodedStreams:
    """Prompts decoded as concurrent streams: each stream's generation, and the wall time of all."""

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
        """Stream 0's whole run, prefill included as in ``tok_s``: wall time and compute (all stages
        plus the coordinator's own work: everything but waiting on the wire), ms per token."""
        result = self.results[0]
        n = max(len(result.tokens), 1)
        compute = result.prefill_compute_ms + result.breakdown.total_ms - result.breakdown.network_ms
        return {"token_ms": self.wall_s * 1e3 / n, "compute_ms": compute / n}


def decode_streams(chain, prompts, tokens: int, *, drafters_=None, k="auto", hooks: Hooks = NO_HOOKS) -> DecodedStreams:
    """Decodes ``prompts`` as concurrent streams of ``tokens`` new tokens each (the end of text
    ignored), timed together."""
    length = max(p.shape[-1] for p in prompts) + tokens + 16
    hooks.check()
    results, wall = generate_streams(chain, prompts, tokens, max_length=length, ignore_eos=True,
                                     drafters=drafters_, scheduling=Scheduling(k=k), on_token=hooks.on_token,
                                     cancels=[hooks.cancel] * len(prompts) if hooks.cancel is not None else None)
    hooks.check()
    return DecodedStreams(results, wall)


def warm_up(chain, prompts, tokens: int, drafters_=None, k="auto", hooks: Hooks = NO_HOOKS) -> None:
    """First inferences (and, with per-stream compiled models, first compiles) are slow, and so is a
    request's first forward past the longest cache or the widest verify it has seen: every stream
    runs one whole generation of ``tokens``, without and then with drafting (at ``k``: the widest
    verify the benchmark runs), before anything is measured: a shorter warm-up leaves the first
    configuration measured slower than the rest."""
    decode_streams(chain, prompts, tokens, hooks=hooks)
    if drafters_:
        decode_streams(chain, prompts, tokens, drafters_=drafters_[: len(prompts)], k=k, hooks=hooks)


def interleave(measure: Callable[[K, int], T], keys: Iterable[K], runs: int, *, warmup: int = 0,
               alternate: bool = False, hooks: Hooks = NO_HOOKS, log: Callable[[str], None] | None = None,
               label: Callable[[K], str] = str) -> dict[K, list[T]]:
    """Measures every configuration (``measure(key, round)``) once a round, taking turns so that the
    machine's drift falls on all of them alike: ``warmup`` rounds whose results are dropped, then
    ``runs`` rounds whose results are kept, per key in round order.  With ``alternate`` every other
    round takes the keys in reverse order, so that no configuration always follows the same one.
    Progress goes to ``hooks`` before each measurement, a line per round to ``log``."""
    keys = list(keys)
    kept: dict[K, list[T]] = {key: [] for key in keys}
    rounds = warmup + runs
    for r in range(rounds):
        for i, key in enumerate(keys[::-1] if alternate and r % 2 else keys):
            hooks.step(r * len(keys) + i, rounds * len(keys), f"round {r + 1}/{rounds}: {label(key)}")
            result = measure(key, r)
            if r >= warmup:
                kept[key].append(result)
        if log:
            log(f"round {r + 1}/{rounds}" + (" (warm-up)" if r < warmup else ""))
    return kept


def rss_mb(pid: int) -> float:
    """A process's resident memory in MB; 0 for one that has ended."""
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


def genai_runner(folder: Path, tokens: int, *, device: str = "CPU", props: dict | None = None,
                 draft: Path | None = None, k: int = 3):
    """OpenVINO GenAI's LLMPipeline on our export, compiled with ``props``, optionally with ``draft``
    as its draft model (``k`` assistant tokens): greedy, ``tokens`` new tokens, EOS ignored, input
    ids as given.  ``run(ids)`` returns (decode tok/s, TTFT ms, tokens)."""
    props = props or {}
    extra = {"draft_model": openvino_genai.draft_model(str(draft), device, **props)} if draft else {}
    pipe = openvino_genai.LLMPipeline(str(folder), device, **extra, **props)
    config = pipe.get_generation_config()
    config.max_new_tokens = config.min_new_tokens = tokens
    config.ignore_eos = True
    config.do_sample = False
    config.apply_chat_template = False
    if draft:
        config.num_assistant_tokens = k

    def run(ids: np.ndarray) -> tuple[float, float, list[int]]:
        result = pipe.generate(openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
        metrics = result.perf_metrics
        return metrics.get_throughput().mean, metrics.get_ttft().mean, list(result.tokens[0])

    return run
