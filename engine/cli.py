"""The ``fleet`` command: models, export, generation and benchmarks from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.config import Settings
from engine.errors import FleetError


class _Bar:
    """A one-line progress display on stderr (redrawn in place on a terminal)."""

    def __init__(self):
        self._tty = sys.stderr.isatty()
        self._last = None

    def show(self, label: str, fraction: float) -> None:
        fraction = max(0.0, min(1.0, fraction))
        filled = int(fraction * 30)
        line = f"{label:<28} [{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}%"
        if self._tty:
            sys.stderr.write("\r" + line + ("\n" if fraction >= 1.0 else ""))
            sys.stderr.flush()
        elif (label, int(fraction * 10)) != self._last:
            self._last = (label, int(fraction * 10))
            print(line, file=sys.stderr, flush=True)


def _pull_progress(bar: _Bar):
    return lambda stage, done, total: bar.show(stage, done / total if total else 1.0)


def cmd_models(args) -> int:
    from engine.models import catalog

    if args.models_cmd == "pull":
        path = catalog.pull(args.name, progress=_pull_progress(_Bar()))
        print(path)
        return 0
    rows = catalog.list_models()
    print(f"{'name':<22}{'arch':<8}{'size':>10}  {'cached':<7}description")
    for r in rows:
        print(f"{r.name:<22}{r.architecture:<8}{r.size / 2**20:>8.0f}MB  {'yes' if r.cached else 'no':<7}{r.description}")
    return 0


def _parse_split(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FleetError(f"--split takes layer boundaries like 10,20, not {text!r}") from None


def _export(model: str, stages: int | None, split: str | None, weights: str, out: str | None, force: bool = False):
    from engine.export.exporter import export_model

    bar = _Bar()
    result = export_model(
        model, stages=stages, split=_parse_split(split), weights=weights, out=Path(out) if out else None,
        progress=lambda i, step, frac: bar.show(f"stage {i}: {step}", frac), force=force,
    )
    return result


def cmd_export(args) -> int:
    result = _export(args.model, args.stages, args.split, args.weights, args.out, args.force)
    print(f"{'stage':<7}{'layers':<10}{'peak MB':>9}{'size MB':>9}{'seconds':>9}  folder")
    for s in result.stages:
        print(f"{s.index:<7}{f'{s.layers[0]}-{s.layers[1]}':<10}{s.peak_rss_mb:>9.0f}{s.size_mb:>9.1f}{s.seconds:>9.1f}  {s.folder}")
    if result.cached:
        print("(already exported: reused the cached shards; --force exports again)")
    return 0


def cmd_generate(args) -> int:
    from engine.runtime.chain import LocalChain
    from engine.runtime.generate import Generator
    from engine.runtime.tokenizer import ChatTokenizer, TextStream

    settings = Settings.load()
    if args.shards:
        shard_dirs = args.shards
    else:
        stages = args.stages or settings.stages
        shard_dirs = _export(args.model or settings.default_model, stages, None, settings.weights, None).folders
    config = {"INFERENCE_PRECISION_HINT": args.precision} if args.precision else {}
    chain = LocalChain(shard_dirs, device=args.device or settings.device, config=config)
    tokenizer = ChatTokenizer(chain.first_folder)
    gen = Generator(chain, max_length=chain.spec.max_position, eos_ids=chain.manifest.eos_token_ids)
    prompts = args.prompt or []
    interactive = not prompts
    results = []
    while True:
        if interactive:
            try:
                prompt = input("you> ") if sys.stdin.isatty() else sys.stdin.read()
            except EOFError:
                break
            if not prompt.strip():
                if sys.stdin.isatty():
                    continue
                break
        elif prompts:
            prompt = prompts.pop(0)
        else:
            break
        ids = tokenizer.prompt_ids(prompt, system=args.system, chat=not args.no_chat)
        stream = TextStream(tokenizer)
        result = gen.generate(
            ids, args.max_new_tokens or settings.max_new_tokens, ignore_eos=args.ignore_eos,
            on_token=lambda t: print(stream.push(t), end="", flush=True),
        )
        print()
        print(f"[{len(result.tokens)} tokens, {result.decode_tok_s:.1f} tok/s, "
              f"first token {result.ttft_s * 1e3:.0f} ms, stopped by {result.stopped_by}]", file=sys.stderr)
        results.append({"prompt": prompt, "text": tokenizer.decode(result.tokens), "tokens": result.tokens,
                        **result.to_json()})
        if interactive and not sys.stdin.isatty():
            break
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def cmd_bench(args) -> int:
    from engine.bench.report import format_table

    if args.name == "parity":
        from engine.bench.parity import run_parity

        report = run_parity(args.model, tokens=args.tokens, warmup=args.warmup, runs=args.runs,
                            weights=args.weights, device=args.device,
                            out=Path(args.json) if args.json else None,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
        print(format_table(report["rows"], ["config", "tok_s", "min", "max", "ttft_ms", "vs_llmpipeline"]))
        return 0
    raise FleetError(f"unknown benchmark {args.name!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleet", description="fleetshard: one LLM across a fleet of PCs")
    sub = parser.add_subparsers(dest="cmd", required=True)

    models = sub.add_parser("models", help="the model catalog")
    msub = models.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="list catalog models and whether they are cached")
    pull = msub.add_parser("pull", help="download, assemble and verify a catalog model")
    pull.add_argument("name")
    models.set_defaults(func=cmd_models)

    export = sub.add_parser("export", help="export a model into per-stage OpenVINO shards")
    export.add_argument("--model", required=True, help="catalog name, GGUF file or Hugging Face folder")
    how = export.add_mutually_exclusive_group()
    how.add_argument("--stages", type=int, help="number of stages (layers split evenly)")
    how.add_argument("--split", help="layer boundaries, e.g. 10,20 for three stages")
    export.add_argument("--weights", default="int4", choices=["int4", "int8", "fp16", "f32"])
    export.add_argument("--out", help="output folder (default: the shard cache)")
    export.add_argument("--force", action="store_true", help="export again even if cached")
    export.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate text through a chain of shards")
    gen.add_argument("--shards", nargs="+", help="shard folders in stage order (or one export folder)")
    gen.add_argument("--model", help="export (or reuse) this model instead of giving --shards")
    gen.add_argument("--stages", type=int, help="with --model: number of stages")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); none: read from stdin")
    gen.add_argument("--system", help="system prompt")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", help="OpenVINO device for every stage (CPU, GPU, NPU, GPU.1...), "
                     "or one per stage separated by commas (CPU,GPU.1)")
    gen.add_argument("--precision", help="inference precision hint (f32, bf16, f16)")
    gen.add_argument("--json", help="write the generations with timings to this file")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="run a benchmark and write a JSON report")
    bench.add_argument("name", choices=["parity"])
    bench.add_argument("--model", default="smollm2-135m")
    bench.add_argument("--tokens", type=int, default=128)
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--runs", type=int, default=5)
    bench.add_argument("--weights", default="int4", choices=["int4", "int8", "fp16", "f32"])
    bench.add_argument("--device", default="CPU")
    bench.add_argument("--json", help="write the report here")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
