"""``fleet models`` (the catalog and the models exported on this PC) and ``fleet export`` (a model
into shards, one per part)."""

from __future__ import annotations

from pathlib import Path

from engine.cli.args import count, progress_printer
from engine.config import DEFAULT_WEIGHTS, paths
from engine.errors import FleetError
from engine.export.compress import HEAD_FORMATS, WEIGHT_FORMATS
from engine.export.choices import choice_of, describe, other_than
from engine.export.gguf_weights import carried_text
from engine.manifest import MANIFEST, layer_numbers, load_manifest, part_name, read_manifest
from engine.models import catalog
from engine.session import export


def cmd_models(args) -> int:
    if args.models_cmd == "pull":
        path = catalog.pull(args.name, progress=progress_printer())
        print(path)
        return 0
    rows = catalog.list_models()
    print("Catalog models (`fleet models pull NAME` downloads one, `fleet export --model NAME` cuts it into parts):")
    print(f"{'name':<22}{'arch':<8}{'size':>10}  {'cached':<7}description")
    for r in rows:
        print(f"{r.name:<22}{r.architecture:<8}{r.size / 2**20:>8.0f}MB  "
              f"{'yes' if r.cached else 'no':<7}{r.description}")
    sets, partial = exported()
    print(f"\nExported on this PC ({paths().shards}):" if sets else "\nNothing exported on this PC yet.")
    for folder, model, weights, parts, size in sets:
        print(f"  {model:<22}{weights:<11}{parts:>3} part{'s' if parts != 1 else ' '} {size / 2**20:>8.0f}MB  "
              f"{folder.name}")
    if partial:
        print(f"  (and {partial} incomplete set{'s' if partial != 1 else ''}: parts the fleet's profiling measured)")
    return 0


def exported() -> tuple[list[tuple[Path, str, str, int, int]], int]:
    """The complete shard sets in the cache, newest first, as (folder, model, weights, parts, bytes), and
    how many sets hold only some of their parts (profiling exports one part of each split).  Only their
    manifests are read (no hashing); a set whose manifest does not read is left out."""
    found, partial = [], 0
    try:
        folders = sorted(paths().shards.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return [], 0
    for folder in folders:
        try:
            held = [read_manifest(p) for p in sorted(folder.iterdir()) if (p / MANIFEST).exists()]
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        except (FleetError, OSError, ValueError):
            continue
        if not held:
            continue
        if len(held) != held[0].stage_count * held[0].ranks:
            partial += 1
            continue
        found.append((folder, held[0].model_name, held[0].weights, len(held), size))
    return found, partial


def parse_split(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FleetError(f"--split takes layer boundaries like 10,20, not {text!r}") from None


def cmd_export(args) -> int:
    result = export(args.model, stages=args.stages, split=parse_split(args.split), weights=args.weights,
                    out=Path(args.out) if args.out else None, force=args.force, head=args.head,
                    ranks=args.ranks, progress=progress_printer())
    if result.stages:
        weights = load_manifest(result.stages[0].folder).weights  # what "auto" resolved to
        choice = choice_of(weights)
        print(f"weights: {weights}" + (f" ({choice.name}: {describe(choice, args.model)})" if choice else ""))
        if choice:
            other = other_than(choice)
            print(f"  {other.name}, --weights {other.weights}: {describe(other, args.model)}")
    print(f"{'part':<7}{'layers':<10}{'peak MB':>9}{'size MB':>9}{'seconds':>9}  folder")
    for s in result.stages:
        print(f"{s.index + 1:<7}{layer_numbers(*s.layers):<10}{s.peak_rss_mb:>9.0f}{s.size_mb:>9.1f}"
              f"{s.seconds:>9.1f}  {s.folder}")
    for s in result.stages:
        carried = load_manifest(s.folder).export.get("gguf_weights")
        if carried:
            print(f"{part_name(s.index)}: {carried_text(carried)}")
    if result.cached:
        print("(already exported: reused the cached shards; --force exports again)")
    return 0


def add_commands(sub) -> None:
    models = sub.add_parser("models", help="the model catalog and the models on this PC (bare: list them)")
    msub = models.add_subparsers(dest="models_cmd")  # none: list
    msub.add_parser("list", help="list catalog models, whether they are cached, and the models exported on this PC")
    pull = msub.add_parser("pull", help="download, assemble and verify a catalog model")
    pull.add_argument("name")
    models.set_defaults(func=cmd_models)

    export = sub.add_parser("export", help="export a model into OpenVINO shards, one per part")
    export.add_argument("--model", required=True, help="catalog name, GGUF file or Hugging Face folder")
    how = export.add_mutually_exclusive_group()
    how.add_argument("--stages", type=count, help="number of parts (layers split evenly)")
    how.add_argument("--split", help="the first layer of each later part, e.g. 10,20 for layers 0-9, 10-19 and 20 on")
    export.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_FORMATS,
                        help="auto (default): a GGUF's own weights (gguf, Faithful) where they all carry over; "
                             "int4-gptq for a float checkpoint under 1B parameters; int4 otherwise")
    export.add_argument("--head", default="int8", choices=HEAD_FORMATS,
                        help="LM head format with --weights int4 (int4: smaller and faster, for draft models)")
    export.add_argument("--ranks", type=int, default=1,
                        help="split every layer into this many tensor-parallel ranks (one PC each) instead of "
                             "parts: rank0/, rank1/... (run rank 0 with the coordinator, the others with "
                             "`fleet worker`)")
    export.add_argument("--out", help="output folder (default: the shard cache)")
    export.add_argument("--force", action="store_true", help="export again even if cached")
    export.set_defaults(func=cmd_export)
