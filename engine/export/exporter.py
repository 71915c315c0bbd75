"""Per-stage export: a model source and a split in, a folder of verified shard folders out.

Every stage is exported in a fresh process that loads only that stage's tensors, so its peak memory
scales with the stage, is measured on its own, and is handed back to the OS when it ends; the
parent only plans, reports progress and can cancel by ending the child.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.config import AUTO_WEIGHTS, DEFAULT_WEIGHTS, int4_layers, paths
from engine.errors import ExportError, FleetError, ShardError
from engine.export import tokenizer as tok
from engine.export.gguf_weights import carry, carry_head, fingerprint, lookup_table, own_head
from engine.export.rankcut import GGUF_UNIT, MLP_UNIT, rank_cuts, ranks_problem
from engine.export.compress import (CALIBRATED, HEAD_FORMATS, WEIGHT_FORMATS, best_weights, compress,
                                    head_table_int4, save_fp16, staging_dtype, vocab_table)
from engine.manifest import MODEL_XML, Manifest, check_chain, layer_span, load_manifest
from engine.models.architectures import architecture
from engine.models.catalog import CATALOG, resolve_source
from engine.models.checkpoint import open_checkpoint
from engine.progress import Report, exporting, quiet

# Bumped whenever the exported graphs change, so cached shards from an older exporter are redone.
EXPORTER_VERSION = 12
STAGE_STEPS = ("load", "calibrate", "convert", "stateful", "compress", "save", "tokenizer", "hash")
INT4_HEAD_ALONE = "an INT4 head goes with --weights int4 (or a calibrated int4-* format)"


def plan_split(num_layers: int, stages: int | None = None, split: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges ``[(0, a), (a, b), ...]`` from a stage count (even split) or boundaries."""
    if split:
        bounds = [0, *split, num_layers]
        if any(b <= a for a, b in zip(bounds, bounds[1:])) or bounds[-2] >= num_layers:
            raise ExportError(
                f"split {','.join(map(str, split))} is not strictly increasing inside 1..{num_layers - 1}"
            )
        return list(zip(bounds, bounds[1:]))
    stages = 1 if stages is None else stages
    if not 1 <= stages <= num_layers:
        raise ExportError(f"cannot cut {num_layers} layers into {stages} stages (1 to {num_layers})")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


@dataclasses.dataclass
class StageReport:
    index: int
    layers: tuple[int, int]
    folder: Path
    peak_rss_mb: float
    seconds: float
    size_mb: float


@dataclasses.dataclass
class ExportResult:
    out: Path
    stages: list[StageReport]
    cached: bool

    @property
    def folders(self) -> list[Path]:
        return [s.folder for s in self.stages]


def default_out(name: str, fingerprint: str, weights: str, ranges: list[tuple[int, int]], beam_idx: bool = True,
                head: str = "int8", ranks: int = 1) -> Path:
    cuts = "-".join(str(end) for _, end in ranges)
    tags = ("" if beam_idx else "-nobeam") + ("" if head == "int8" else f"-head{head}")
    tags += f"-tp{ranks}" if ranks > 1 else ""
    return paths().shards / f"{name}-{weights}-{cuts}{tags}-{fingerprint[:10]}"


def stage_folder(out: Path, index: int) -> Path:
    return Path(out) / f"stage{index}"


def rank_folder(out: Path, rank: int) -> Path:
    return Path(out) / f"rank{rank}"


def export_model(
    source: str,
    *,
    stages: int | None = None,
    split: list[int] | None = None,
    weights: str = DEFAULT_WEIGHTS,
    out: Path | None = None,
    progress: Report = quiet,
    cancel=None,
    force: bool = False,
    beam_idx: bool = True,
    only: list[int] | None = None,
    head: str = "int8",
    ranks: int = 1,
) -> ExportResult:
    """Exports ``source`` (catalog name, GGUF path or HF folder) into one shard folder per stage.

    ``cancel`` is anything with ``is_set()``; when it becomes set the running stage is ended and the
    partial output removed.  An existing complete export at ``out`` is reused unless ``force``.
    ``only`` exports just those stage indices of the split (a profile needs the first and last few
    layers, not the whole model).  ``head="int4"`` stores the LM head (of an int4 export) in INT4
    too, for draft models.  A ``compress.CALIBRATED`` format runs the float model over the
    calibration text first (``engine.export.calibration``), in each stage's own process.
    ``ranks`` > 1 exports a whole model as that many tensor-parallel ranks instead of stages
    (``rank_folder``; ``engine.transport.mesh``): each holds every layer's share of heads and
    MLP columns and its share of the vocabulary.
    """
    if head not in HEAD_FORMATS:
        raise ExportError(f"unknown head format {head!r}; choose one of {', '.join(HEAD_FORMATS)}")
    if head == "int4" and weights != AUTO_WEIGHTS and not int4_layers(weights):
        raise ExportError(INT4_HEAD_ALONE)
    if weights not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if source in CATALOG:
        architecture(CATALOG[source].architecture)  # refuse before downloading what cannot be exported
    resolved = resolve_source(source)
    if weights == "gguf" and resolved.kind != "gguf":
        raise ExportError(f"the gguf weight format carries a GGUF file's own quantization over; "
                          f"{source} is not a GGUF model")
    spec = open_checkpoint(resolved.kind, resolved.path).spec
    if weights == AUTO_WEIGHTS:
        weights = best_weights(resolved.kind, spec, resolved.path)
        if head == "int4" and not int4_layers(weights):
            raise ExportError(f"{INT4_HEAD_ALONE}; auto exports {source} as {weights}")
    ranges = plan_split(spec.num_layers, stages, split)
    if ranks > 1:
        _check_ranks(spec, ranks, len(ranges), weights)
    name = resolved.entry.name if resolved.entry else resolved.path.stem
    out = Path(out) if out else default_out(name, resolved.fingerprint, weights, ranges, beam_idx, head, ranks)

    indices = sorted(set(only)) if only else list(range(len(ranges)))
    if indices[0] < 0 or indices[-1] >= len(ranges):
        raise ExportError(f"stage indices {only} do not exist in a {len(ranges)}-stage split")
    cached = None if force else _reuse(out, resolved.fingerprint, weights, ranges, beam_idx, indices, head, ranks)
    if cached is not None:
        return ExportResult(out, cached, cached=True)

    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for index in indices:
        start, end = ranges[index]
        for rank in range(ranks):
            job = dict(
                kind=resolved.kind, path=str(resolved.path), name=name, fingerprint=resolved.fingerprint,
                start=start, end=end, index=index, count=len(ranges), weights=weights,
                folder=str(rank_folder(out, rank) if ranks > 1 else stage_folder(out, index)),
                beam_idx=beam_idx, head=head, rank=rank, ranks=ranks,
            )
            reports.append(_run_stage(job, progress, cancel))
    return ExportResult(out, reports, cached=False)


def _check_ranks(spec, ranks: int, stages: int, weights: str) -> None:
    if stages > 1:
        raise ExportError("tensor-parallel ranks hold a whole model each: export them without a split")
    problem = ranks_problem(spec, ranks, weights)
    if problem:
        raise ExportError(problem)


def _reuse(out: Path, fingerprint: str, weights: str, ranges, beam_idx: bool,
           indices: list[int], head: str = "int8", ranks: int = 1) -> list[StageReport] | None:
    folders = [rank_folder(out, r) for r in range(ranks)] if ranks > 1 else [stage_folder(out, i) for i in indices]
    indices = [indices[0]] * ranks if ranks > 1 else indices
    try:
        manifests = [load_manifest(f) for f in folders]
        if len(indices) == len(ranges):
            check_chain(manifests)
    except ShardError:
        return None
    if any(m.fingerprint != fingerprint or m.weights != weights or tuple(m.layers) != ranges[i]
           or m.stage_index != i or m.ranks != ranks or m.export.get("beam_idx", True) != beam_idx
           or m.export.get("head", "int8") != head
           or m.export.get("exporter") != EXPORTER_VERSION
           for m, i in zip(manifests, indices)):
        return None
    runs = [{**m.export, **_read_run(f)} for f, m in zip(folders, manifests)]  # older exports: in the manifest
    return [
        StageReport(m.stage_index, tuple(m.layers), f, run.get("peak_rss_mb", 0.0), run.get("seconds", 0.0),
                    _size_mb(f))
        for f, m, run in zip(folders, manifests, runs)
    ]


def _run_file(folder: Path) -> Path:
    """What a stage's export cost (peak memory, seconds), beside its folder: kept out of the manifest,
    whose hash names the shard, so the same stage exported twice is the same shard."""
    return Path(folder).with_name(Path(folder).name + ".export.json")


def _read_run(folder: Path) -> dict:
    try:
        return json.loads(_run_file(folder).read_text())
    except (OSError, ValueError):
        return {}


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file()) / 2**20


def _run_stage(job: dict, progress: Report, cancel) -> StageReport:
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    child = ctx.Process(target=_stage_main, args=(job, events), daemon=True)
    child.start()
    result = None
    try:
        while result is None:
            if cancel is not None and cancel.is_set():
                child.terminate()
                child.join()
                shutil.rmtree(job["folder"] + ".partial", ignore_errors=True)
                raise ExportError(f"export cancelled during stage {job['index']}")
            try:
                # A child that just exited may still have its last messages in the pipe: drain first.
                kind, payload = events.get(timeout=0.2 if child.is_alive() else 2.0)
            except queue.Empty:
                if not child.is_alive():
                    log = Path(job["folder"]).with_suffix(".log")
                    tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                    raise ExportError(
                        f"stage {job['index']} export process died (exit code {child.exitcode}"
                        f"{', killed: out of memory?' if child.exitcode and child.exitcode < 0 else ''})"
                        + (":\n" + "\n".join(tail) if tail else "")
                    ) from None
                continue
            if kind == "progress":
                progress(payload)
            elif kind == "error":
                raise ExportError(f"stage {job['index']} ({layer_span(job['start'], job['end'])}): {payload}")
            elif kind == "done":
                result = payload
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    return StageReport(job["index"], (job["start"], job["end"]), Path(job["folder"]), result["peak_rss_mb"],
                       result["seconds"], _size_mb(Path(job["folder"])))


def _peak_rss_mb() -> float:
    try:  # resource is POSIX only: Windows reads the peak from psutil instead
        import resource

        scale = 1024 if sys.platform != "darwin" else 1
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
    except ImportError:  # Windows
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20


def _describe(ports) -> list[dict]:
    return [{"name": p.get_any_name(), "shape": str(p.get_partial_shape()),
             "dtype": p.get_element_type().get_type_name()} for p in ports]


def _staged_matrices(stage) -> dict[bytes, tuple[str, int, tuple | None]]:
    """Each layer matrix of a traced stage by its fingerprint: (part, layer, the axis and slice a
    tensor-parallel rank keeps of it or None), for ``gguf_weights.carry``."""
    from engine.export.decoder import MATRICES  # torch, as export_stage's imports

    cuts = rank_cuts(stage.spec, stage.rank, stage.ranks, stage.unit)[0] if stage.ranks > 1 else {}
    return {fingerprint(getattr(layer, part).detach().numpy()): (part, stage.start + i, cuts.get(part))
            for i, layer in enumerate(stage.layers) for part in MATRICES}


def _vocabulary(ckpt, job: dict):
    """The embedding table (first stage) and head (last stage) as graph outputs, built one at a
    time from the checkpoint; a tied single-stage model shares one table.  For ``gguf`` an
    embedding that is not also the head keeps the GGUF's codes (``gguf_weights.lookup_table``), and
    a head of the model's own is a stand-in here, carried with its codes after (``carry_head``)."""
    first, last = job["start"] == 0, job["end"] == ckpt.spec.num_layers
    dtype = staging_dtype(job["weights"])
    ranks = job.get("ranks", 1)
    embed = None
    if first:
        if job["weights"] == "gguf" and not (last and ckpt.spec.tie_embeddings):
            embed = lookup_table(ckpt)
        if embed is None:
            embed = vocab_table(ckpt.read("embed", dtype=dtype), job["weights"])
    head = None
    if last:
        rows = _vocabulary_rows(ckpt, job)
        if job.get("head") == "int4":
            head = head_table_int4(ckpt.read_head(dtype=dtype)[rows])
        elif job["weights"] == "gguf" and own_head(ckpt) is not None:  # carried after: a stand-in here
            head = ops.broadcast(ops.constant(np.float32(0)),
                                 ops.constant(np.array([rows.stop - rows.start, ckpt.spec.hidden_size]))).output(0)
        elif first and ckpt.spec.tie_embeddings and ranks == 1:
            head = embed
        else:
            head = vocab_table(ckpt.read_head(dtype=dtype)[rows], job["weights"])
    return embed, head


def _vocabulary_rows(ckpt, job: dict) -> slice:
    """The head's rows a stage holds: all of them, or a tensor-parallel rank's share."""
    vocab, rank, ranks = ckpt.spec.vocab_size, job.get("rank", 0), job.get("ranks", 1)
    return slice(vocab * rank // ranks, vocab * (rank + 1) // ranks)


def _release_free_memory() -> None:
    """Hands freed heap back to the OS (glibc keeps it otherwise): dequantizing leaves many
    large temporaries behind, and the stage's measured peak should be its real working set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _stage_main(job: dict, events) -> None:
    """Child process: export one stage into ``folder`` (written as ``folder.partial``, then renamed).

    The converters' own chatter (trace warnings, NNCF progress bars) goes to ``stageN.log`` beside
    the stage folder; progress and errors travel to the parent through ``events``.
    """
    log = open(Path(job["folder"]).with_suffix(".log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    warnings.simplefilter("ignore")
    try:
        events.put(("done", export_stage(job, lambda progress: events.put(("progress", progress)))))
    except FleetError as exc:
        events.put(("error", str(exc)))
    except Exception as exc:  # anything else is a bug or a conversion failure: say what it was
        events.put(("error", f"{type(exc).__name__}: {exc}"))


def export_stage(job: dict, report: Report) -> dict:
    # torch: only the export's own process loads it (the runtime imports this module, and must not)
    from engine.export.decoder import DecoderStage
    from engine.export.graph import attach_vocabulary, convert_stage, io_names, make_stateful  # torch, as above

    t0 = time.perf_counter()
    folder = Path(job["folder"])
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    steps = iter(enumerate(STAGE_STEPS))

    def step():
        i, name = next(steps)
        report(exporting(job["index"], job["count"], name, i / len(STAGE_STEPS)))

    step()
    ckpt = open_checkpoint(job["kind"], Path(job["path"]))
    hf_tok = None
    step()
    calibration = None
    if job["weights"] in CALIBRATED:
        from engine.export import calibration as cal  # torch (earlier layers' hidden states), as above

        hf_tok = tok.load_hf_tokenizer(job["kind"], Path(job["path"]))
        calibration = cal.stage_inputs(ckpt, job["start"], cal.token_sequences(hf_tok))
        _release_free_memory()
    # Vocabulary tables first: their float staging is gone before the layers arrive.
    vocabulary = _vocabulary(ckpt, job)
    _release_free_memory()
    stage = DecoderStage(ckpt, job["start"], job["end"], weight_dtype=staging_dtype(job["weights"]),
                         rank=job.get("rank", 0), ranks=job.get("ranks", 1),
                         unit=GGUF_UNIT if job["weights"] == "gguf" else MLP_UNIT)
    _release_free_memory()
    in_names, _, pairs = io_names(stage)
    matrices = _staged_matrices(stage) if job["weights"] == "gguf" else None
    step()
    model = convert_stage(stage)
    del stage
    scale = ckpt.spec.hidden_size ** 0.5 if ckpt.arch.scaled_embeddings else None
    model = attach_vocabulary(model, *vocabulary, embed_scale=scale, ranks=job.get("ranks", 1))
    del vocabulary
    step()
    model = make_stateful(model, pairs, in_names[0], beam_idx=job.get("beam_idx", True))
    step()
    carried = carry(model, ckpt, matrices) if matrices is not None else None
    last = job["end"] == ckpt.spec.num_layers
    head = own_head(ckpt) if carried is not None and last and job.get("head") != "int4" else None
    if head is not None:
        name = carry_head(model, head, _vocabulary_rows(ckpt, job))
        carried["carried"][name] = carried["carried"].get(name, 0) + 1
    dataset = cal.dataset(calibration, in_names[0], job.get("beam_idx", True)) if calibration is not None else None
    model = compress(model, job["weights"], dataset)
    del dataset
    _release_free_memory()
    step()
    ov.save_model(model, partial / MODEL_XML, compress_to_fp16=save_fp16(job["weights"]))
    inputs, outputs = _describe(model.inputs), _describe(model.outputs)
    del model
    step()
    eos = []
    if job["start"] == 0:
        hf_tok = hf_tok or tok.load_hf_tokenizer(job["kind"], Path(job["path"]))
        eos = tok.stop_token_ids(hf_tok)
        tok.write_tokenizer(hf_tok, partial)
        tok.write_hf_configs(hf_tok, ckpt.spec, partial, eos)
    step()
    peak = _peak_rss_mb()
    seconds = time.perf_counter() - t0
    manifest = Manifest(
        model_name=job["name"], fingerprint=job["fingerprint"], spec=ckpt.spec,
        stage_index=job["index"], stage_count=job["count"], layers=(job["start"], job["end"]),
        weights=job["weights"], inputs=inputs, outputs=outputs,
        states=[p for p, _ in pairs], eos_token_ids=eos,
        export={"source": job["path"],
                "beam_idx": job.get("beam_idx", True), "head": job.get("head", "int8"),
                **({"gguf_weights": carried} if carried is not None else {}),
                **({"tensor_parallel": {"rank": job["rank"], "ranks": job["ranks"]}}
                   if job.get("ranks", 1) > 1 else {}),
                **({"calibration": {"text": cal.TEXT.name, "sequences": int(calibration.shape[0]),
                                    "tokens": int(calibration.shape[1]), **CALIBRATED[job["weights"]]}}
                   if calibration is not None else {}),
                "exporter": EXPORTER_VERSION,
                "openvino": ov.get_version()},
    )
    manifest.write(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    run = {"peak_rss_mb": round(peak, 1), "seconds": round(seconds, 2)}
    _run_file(folder).write_text(json.dumps(run))
    report(exporting(job["index"], job["count"], "done", 1.0))
    return run
