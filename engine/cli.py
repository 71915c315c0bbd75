"""The ``fleet`` command: models, export, generation and benchmarks from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.cliargs import count, duration
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


def _export(model: str, stages: int | None, split: str | None, weights: str, out: str | None, force: bool = False,
            head: str = "int8"):
    from engine.export.exporter import export_model

    bar = _Bar()
    result = export_model(
        model, stages=stages, split=_parse_split(split), weights=weights, out=Path(out) if out else None,
        progress=lambda i, step, frac: bar.show(f"stage {i}: {step}", frac), force=force, head=head,
    )
    return result


def cmd_export(args) -> int:
    from engine.manifest import layer_numbers

    result = _export(args.model, args.stages, args.split, args.weights, args.out, args.force, args.head)
    print(f"{'stage':<7}{'layers':<10}{'peak MB':>9}{'size MB':>9}{'seconds':>9}  folder")
    for s in result.stages:
        print(f"{s.index:<7}{layer_numbers(*s.layers):<10}{s.peak_rss_mb:>9.0f}{s.size_mb:>9.1f}{s.seconds:>9.1f}  {s.folder}")
    if result.cached:
        print("(already exported: reused the cached shards; --force exports again)")
    return 0


def open_chain(args, settings: Settings):
    """The chain ``fleet generate`` asked for: in-process, stage 0 here and the rest remote, or a
    local fleet of worker processes.  Returns (chain, local fleet or None)."""
    from engine.fleetkey import key_file, load_key, load_tls
    from engine.runtime.stages.chain import LocalChain, expand_shard_dirs, parse_devices
    from engine.runtime.stages.stage import compile_config
    from engine.runtime.stages.turns import compute_turns

    if sum(map(bool, (args.remote, args.local_workers, args.deployment))) > 1:
        raise FleetError("--remote, --local-workers and --deployment exclude each other")
    if args.deployment:
        from engine.fleet.deploy import Deployment

        record = Deployment.load(None if args.deployment == "last" else Path(args.deployment))
        return record.chain(load_key(args.fleet_key_file), tls=load_tls(args.tls or settings.tls, args.fleet_key_file),
                            deadline_s=args.deadline or settings.deadline_s, connect_timeout_s=args.connect_timeout,
                            isolate=args.isolate_streams), None
    if args.shards:
        shard_dirs = expand_shard_dirs(args.shards)
    else:
        stages = args.stages or settings.stages
        shard_dirs = _export(args.model or settings.default_model, stages, None, settings.weights, None).folders
    mode = args.mode or settings.mode
    device = args.device or settings.device
    if not (args.remote or args.local_workers):
        return LocalChain(shard_dirs, device=device, config=compile_config(mode, args.precision),
                          isolate=args.isolate_streams), None

    from engine.runtime.relay.remote import RemoteChain

    tls_on = args.tls or settings.tls
    key = load_key(args.fleet_key_file, create=args.local_workers)
    tls = load_tls(tls_on, args.fleet_key_file)
    deadline = args.deadline or settings.deadline_s
    fleet = None
    if args.remote:
        if len(shard_dirs) != 1:
            raise FleetError("with --remote, give only the stage-0 shard folder in --shards")
        remotes = [a.strip() for a in args.remote.split(",") if a.strip()]
        devices = [device]
    else:
        from engine.runtime.relay.localfleet import LocalFleet

        if len(shard_dirs) < 2:
            raise FleetError("--local-workers needs a model split into at least 2 stages")
        devices = parse_devices(device, len(shard_dirs))
        fleet = LocalFleet(shard_dirs[1:], key_file(args.fleet_key_file), devices=devices[1:],
                           mode=mode, precision=args.precision, delay_ms=args.delay_ms or 0.0, tls=tls_on,
                           deadline_s=deadline, isolate=args.isolate_streams).start()
        remotes = fleet.addresses
    try:
        chain = RemoteChain(shard_dirs[0], remotes, key=key, device=devices[0], mode=mode,
                            precision=args.precision, tls=tls,
                            deadline_s=deadline, connect_timeout_s=args.connect_timeout,
                            isolate=args.isolate_streams, turns=compute_turns(fleet.turns if fleet else None))
    except BaseException:
        if fleet is not None:
            fleet.close()
        raise
    return chain, fleet


def open_drafter(args, settings: Settings, chain, streams: int):
    """One drafter per stream, or None: ``lookup``, a draft model (shard folder or model source), or
    ``hybrid:MODEL`` (lookup or the model, per round)."""
    from engine.runtime.stages.chain import expand_shard_dirs
    from engine.runtime.decode.speculative import draft_head, open_draft_chain, stream_drafters

    spec = args.draft
    if not spec or spec == "lookup":
        return stream_drafters("lookup" if spec else "none", streams)
    hybrid = spec.startswith("hybrid:")
    source = spec.split(":", 1)[1] if hybrid else spec
    if Path(source).exists():
        folders = expand_shard_dirs([source])
    else:
        folders = _export(source, 1, None, settings.weights, None, head=draft_head(settings.weights)).folders
    draft_chain = open_draft_chain(folders, (args.device or settings.device).split(",")[0])
    return stream_drafters("hybrid" if hybrid else "model", streams, chain.manifest, draft_chain)


def _k(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes a number or 'auto', not {text!r}") from None
    if not 0 <= value <= 32:
        raise argparse.ArgumentTypeError("--k must be between 0 and 32")
    return value


def cmd_generate(args) -> int:
    from engine.runtime.decode.generate import Generator
    from engine.runtime.stages.stage import REWIND
    from engine.runtime.decode.tokenizer import ChatTokenizer, TextStream

    settings = Settings.load()
    prompts = list(args.prompt or [])
    if args.prompts:
        try:
            prompts += [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise FleetError(f"cannot read --prompts {args.prompts}: {exc.strerror}") from None
    streams = args.streams or 1
    args.rewind = args.rewind or REWIND[args.mode or settings.mode]
    if streams > 1 and not prompts:
        raise FleetError("--streams needs prompts (--prompt repeated or --prompts FILE)")
    from engine.runtime.decode.sampling import SamplingParams

    args.sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.repetition_penalty, args.seed)
    chain, fleet = open_chain(args, settings)
    try:
        tokenizer = ChatTokenizer(chain.first_folder)
        drafters = open_drafter(args, settings, chain, streams)
        if streams > 1:
            results = _stream_batch(args, settings, chain, tokenizer, prompts, streams, drafters)
        else:
            gen = Generator(chain, max_length=chain.spec.max_position, eos_ids=chain.manifest.eos_token_ids,
                            rewind=args.rewind)
            results = _chat_loop(args, settings, tokenizer, gen, TextStream, prompts,
                                 drafters[0] if drafters else None)
    finally:
        chain.close()
        if fleet is not None:
            fleet.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _stream_batch(args, settings, chain, tokenizer, prompts, streams, drafters) -> list[dict]:
    """Micro-batching: prompts in rounds of ``streams`` concurrent streams."""
    from engine.runtime.decode.generate import generate_streams

    results = []
    for start in range(0, len(prompts), streams):
        batch = prompts[start : start + streams]
        ids = [tokenizer.prompt_ids(p, system=args.system, chat=not args.no_chat) for p in batch]
        gens, wall = generate_streams(chain, ids, args.max_new_tokens or settings.max_new_tokens,
                                      max_length=chain.spec.max_position, eos_ids=chain.manifest.eos_token_ids,
                                      ignore_eos=args.ignore_eos, rewind=args.rewind,
                                      drafters=drafters[: len(batch)] if drafters else None, k=args.k,
                                      sampling=args.sampling)
        total = sum(len(g.tokens) for g in gens)
        for i, (prompt, g) in enumerate(zip(batch, gens)):
            text = tokenizer.decode(g.tokens)
            print(f"--- stream {i} ({len(g.tokens)} tokens, {g.decode_tok_s:.1f} tok/s"
                  + (f", acceptance {g.acceptance:.2f}" if g.drafted else "") + f")\n{text}")
            results.append({"stream": i, "prompt": prompt, "text": text, "tokens": g.tokens, **g.to_json()})
        print(f"[{len(batch)} streams, {total} tokens in {wall:.2f} s: {total / wall:.1f} tok/s aggregate]",
              file=sys.stderr)
    return results


def _chat_loop(args, settings: Settings, tokenizer, gen, text_stream, prompts, drafter) -> list[dict]:
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
        stream = text_stream(tokenizer)
        result = gen.generate(
            ids, args.max_new_tokens or settings.max_new_tokens, ignore_eos=args.ignore_eos,
            on_token=lambda t: print(stream.push(t), end="", flush=True), drafter=drafter, k=args.k,
            sampling=args.sampling,
        )
        print()
        spec = f", acceptance {result.acceptance:.2f}" if result.drafted else ""
        print(f"[{len(result.tokens)} tokens, {result.decode_tok_s:.1f} tok/s, "
              f"first token {result.ttft_s * 1e3:.0f} ms{spec}, stopped by {result.stopped_by}]", file=sys.stderr)
        results.append({"prompt": prompt, "text": tokenizer.decode(result.tokens), "tokens": result.tokens,
                        **result.to_json()})
        if interactive and not sys.stdin.isatty():
            break
    return results


def cmd_worker(args) -> int:
    from engine.fleetkey import load_key, load_tls
    from engine.runtime.relay.affinity import pin
    from engine.runtime.stages.turns import compute_turns
    from engine.runtime.relay.worker import Worker

    pin(args.cpus)
    settings = Settings.load()
    key = load_key(args.fleet_key_file)
    tls = load_tls(args.tls or settings.tls, args.fleet_key_file)
    worker = Worker(args.shard, args.listen, args.next, key=key, device=args.device or settings.device,
                    mode=args.mode or settings.mode, precision=args.precision, delay_ms=args.delay_ms,
                    deadline_s=args.deadline or settings.deadline_s, tls=tls, isolate=args.isolate_streams,
                    turns=compute_turns(args.compute_turns))
    if args.lifeline:  # only now: a thread running while OpenVINO starts can hang the child it forks
        from engine.launch import lifeline

        lifeline()
    from engine.manifest import layer_span

    m = worker.manifest
    print(f"stage {m.stage_index} of {m.stage_count} ({layer_span(*m.layers)}) on "
          f"{worker.runner.device}, listening on {worker.address}"
          + (f", next stage {args.next}" if args.next else ""), file=sys.stderr, flush=True)
    print(f"ready {worker.address}", flush=True)
    worker.serve_forever()
    return 0


def cmd_key(args) -> int:
    from engine.fleetkey import create_certificate, create_key, key_file, tls_file

    if args.key_cmd == "api":
        from engine.fleetkey import api_key_file, load_api_key

        key = load_api_key(create=True, force=args.new)
        print(key)
        print(f"(kept in {api_key_file()}; HTTP clients send it as `Authorization: Bearer <key>`)", file=sys.stderr)
        return 0
    path = key_file(args.fleet_key_file)
    if args.key_cmd == "init":
        create_key(path, force=args.force)
        print(f"fleet key written to {path}; copy it to every machine of the fleet")
        if args.tls:
            pem = create_certificate(tls_file(path), force=args.force)
            print(f"fleet TLS certificate written to {pem}; copy it beside the key on every machine")
        return 0
    if not path.exists():
        raise FleetError(f"no fleet key at {path}: run `fleet key init`")
    print(path)
    return 0


def _counts(text: str) -> tuple[int, ...]:
    return tuple(count(part) for part in text.split(","))


def _delays(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"delays are comma-separated milliseconds, not {text!r}") from None


def cmd_bench(args) -> int:
    """Every benchmark writes the same report (``engine.bench.report``) and prints its table."""
    import importlib

    from engine.bench.report import format_table

    draft = args.draft or "qwen2.5-coder-0.5b"
    common = {"weights": args.weights, "out": Path(args.json) if args.json else None,
              "log": lambda m: print(m, file=sys.stderr, flush=True)}
    # the speculation and fleet benchmarks run the 1.5B target that has a 0.5B draft
    model = args.model or ("smollm2-135m" if args.name in ("parity", "pipeline", "placement", "fuzz", "soak")
                           else "qwen2.5-coder-1.5b")
    fleet = {"cpu_sets": args.cpus or ""}
    # each benchmark has its own default length, repetitions and stage count
    sizes = {k: v for k, v in (("tokens", args.tokens), ("stages", args.stages)) if v}
    runs = {"runs": args.runs} if args.runs else {}
    delays = {"delays": args.delays} if args.delays else {}
    kind = {"draft_kind": args.draft_kind}
    calls = {
        "parity": lambda f: f(model, warmup=args.warmup, device=args.device, tokens=args.tokens or 128, **runs,
                              **common),
        "pipeline": lambda f: f(model, warmup=args.warmup, delay_ms=args.delay_ms, **sizes, **runs, **common),
        "spec": lambda f: f(model, draft, k=args.spec_k, tokens=args.tokens or 128, **runs, **common),
        "ksweep": lambda f: f(model, draft, **sizes, **kind, **delays, **fleet, **common),
        "microbatch": lambda f: f(model, tokens=args.tokens or 64, **runs, **delays, **fleet, **common,
                                  **({"stage_counts": (args.stages,)} if args.stages else {})),
        "wan": lambda f: f(model, draft, **sizes, **runs, **kind, **delays, **fleet, **common),
        "progression": lambda f: f(model, draft, delay_ms=args.delay_ms, **sizes, **runs, **kind, **fleet, **common),
        "placement": lambda f: f(model, tokens=args.tokens or 64, **runs, **common),
        "serve": lambda f: f(model, tokens=args.tokens or 64, device=args.device, **runs, **common,
                             **({"stages": args.stages} if args.stages else {}),
                             **({"users": args.users} if args.users else {}),
                             **({"parts": tuple(args.parts.split(","))} if args.parts else {})),
        "batch": lambda f: f(model, tokens=args.tokens or 32, device=args.device, **runs, **common,
                             **({"stage_counts": (args.stages,)} if args.stages else {}),
                             **({"streams": args.users} if args.users else {})),
        "fuzz": lambda f: f(model, cases=args.cases, weights=args.weights, out=common["out"], log=common["log"]),
        "soak": lambda f: f(model, users=max(args.users or (8,)), minutes=args.minutes, kill_every_s=args.kill_every,
                            tokens=args.tokens or 32, **({"stages": args.stages} if args.stages else {}), **common),
    }
    module = importlib.import_module(f"engine.bench.{args.name}")
    report = calls[args.name](getattr(module, f"run_{args.name}"))
    columns = list(dict.fromkeys(c for row in report["rows"] for c in row))
    print(format_table(report["rows"], columns))
    print("\n".join(f"{k}: {v}" for k, v in report["ratios"].items()))
    return 0


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet-key-file", help="the shared fleet key (default: from the settings)")
    parser.add_argument("--tls", action="store_true", help="TLS with the fleet certificate beside the key")
    parser.add_argument("--deadline", type=duration, help="seconds of silence before a stage counts as dead")


def _chain_args(parser: argparse.ArgumentParser) -> None:
    """Where the model runs and how it decodes: what `generate` and `serve` open with ``open_chain``."""
    parser.add_argument("--shards", nargs="+", help="shard folders in stage order (or one export folder)")
    parser.add_argument("--model", help="export (or reuse) this model instead of giving --shards")
    parser.add_argument("--stages", type=count, help="with --model: number of stages")
    parser.add_argument("--draft", help="speculative decoding: 'lookup' (prompt lookup, no model), a draft "
                        "model (shard folder or model source with the target's tokenizer), or hybrid:MODEL")
    parser.add_argument("--isolate-streams", action="store_true",
                        help="compile each stage once per stream instead of sharing one compiled model")
    parser.add_argument("--k", type=_k, default=4, help="draft tokens per round, or 'auto' (default 4)")
    parser.add_argument("--mode", choices=["fast", "exact"],
                        help="exact: speculative output token-identical to plain greedy decoding (f32 compute)")
    parser.add_argument("--device", help="OpenVINO device for every stage (CPU, GPU, NPU, GPU.1...), "
                        "or one per stage separated by commas (CPU,GPU.1)")
    parser.add_argument("--precision", help="the target's inference precision hint (f32, bf16, f16); "
                        "a draft keeps its device's default")
    parser.add_argument("--remote", help="run stage 0 here and the rest on workers: HOST:PORT of stage 1 "
                        "(and optionally of the later stages, comma-separated)")
    parser.add_argument("--local-workers", action="store_true",
                        help="run stages 1.. as worker processes on this machine (the local fleet)")
    parser.add_argument("--deployment", nargs="?", const="last",
                        help="use the chain `fleet deploy`/`fleet up` started (default: the last one recorded)")
    parser.add_argument("--delay-ms", type=duration,
                        help="with --local-workers: one-way delay per hop (WAN simulation)")
    _connection_args(parser)
    parser.add_argument("--connect-timeout", type=duration, default=60.0,
                        help="seconds to wait for the chain to come up")


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("fleetshard")
    except PackageNotFoundError:  # a checkout that was never installed
        release = "unknown"
    parser = argparse.ArgumentParser(prog="fleet", description="fleetshard: one LLM across a fleet of PCs")
    parser.add_argument("--version", action="version", version=f"fleet (fleetshard) {release}")
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
    how.add_argument("--stages", type=count, help="number of stages (layers split evenly)")
    how.add_argument("--split", help="the first layer of each later stage, e.g. 10,20 for layers 0-9, 10-19 and 20 on")
    export.add_argument("--weights", default="int4", choices=["int4", "int8", "fp16", "f32"])
    export.add_argument("--head", default="int8", choices=["int8", "int4"],
                        help="LM head format with --weights int4 (int4: smaller and faster, for draft models)")
    export.add_argument("--out", help="output folder (default: the shard cache)")
    export.add_argument("--force", action="store_true", help="export again even if cached")
    export.set_defaults(func=cmd_export)

    gen = sub.add_parser("generate", help="generate text through a chain of shards")
    _chain_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); none: read from stdin")
    gen.add_argument("--prompts", help="a file with one prompt per line")
    gen.add_argument("--streams", type=count, help="generate this many prompts concurrently (micro-batching)")
    gen.add_argument("--rewind", choices=["mask", "trim"],
                     help="stateful stages: drop rejected drafts by masking them (fast mode's default) or "
                     "trimming the KV cache (exact mode's default); paged stages always trim, at no cost")
    gen.add_argument("--system", help="system prompt")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-new-tokens", type=count)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", help="write the generations with timings to this file")
    gen.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample from the likeliest tokens holding this much "
                     "probability")
    gen.add_argument("--top-k", type=int, default=0, help="sample from this many likeliest tokens (0: no limit)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1: tokens already in the text "
                     "are less likely")
    gen.add_argument("--seed", type=int, help="the same seed, prompt and settings give the same sampled text")
    gen.set_defaults(func=cmd_generate)

    from engine.serve.command import add_serve_command

    add_serve_command(sub, _chain_args)

    worker = sub.add_parser("worker", help="serve one shard as a stage of the pipeline")
    worker.add_argument("--shard", required=True, help="the shard folder this worker serves")
    worker.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any free port)")
    worker.add_argument("--next", help="HOST:PORT of the next stage (default: the coordinator names it)")
    worker.add_argument("--device", help="OpenVINO device (CPU, GPU, NPU, GPU.1...)")
    worker.add_argument("--precision", help="inference precision hint (f32, bf16, f16)")
    worker.add_argument("--mode", choices=["fast", "exact"], help="correctness mode (every stage must agree)")
    worker.add_argument("--delay-ms", type=duration, default=0.0,
                        help="add this one-way delay to every frame received and sent upstream")
    worker.add_argument("--isolate-streams", action="store_true",
                        help="compile the shard once per stream instead of sharing one compiled model")
    worker.add_argument("--cpus", help="pin this worker to these CPUs (Linux; like taskset: 0-3,6)")
    worker.add_argument("--compute-turns", metavar="FILE",
                        help="compute one at a time with the other stages on this computer that name the same file")
    worker.add_argument("--lifeline", action="store_true", help=argparse.SUPPRESS)
    _connection_args(worker)
    worker.set_defaults(func=cmd_worker)

    key = sub.add_parser("key", help="the fleet key every machine shares")
    ksub = key.add_subparsers(dest="key_cmd", required=True)
    kinit = ksub.add_parser("init", help="create a new fleet key (and with --tls a fleet certificate)")
    kinit.add_argument("--force", action="store_true", help="replace an existing key")
    kinit.add_argument("--tls", action="store_true", help="also create a self-signed fleet TLS certificate")
    kinit.add_argument("--fleet-key-file", help="where to write the key (default: the config folder)")
    kshow = ksub.add_parser("path", help="print where the fleet key is")
    kshow.add_argument("--fleet-key-file")
    kapi = ksub.add_parser("api", help="print the API key HTTP clients of `fleet serve` need off loopback "
                                       "(created if there is none)")
    kapi.add_argument("--new", action="store_true", help="replace it with a new key (clients need the new one)")
    key.set_defaults(func=cmd_key)

    bench = sub.add_parser("bench", help="run a benchmark and write a JSON report")
    bench.add_argument("name", choices=["parity", "pipeline", "spec", "ksweep", "microbatch", "wan", "progression",
                                               "placement", "serve", "fuzz", "soak", "batch"])
    bench.add_argument("--model", help="the target model (default: smollm2-135m; qwen2.5-coder-1.5b for "
                       "spec, ksweep, microbatch, wan, progression, serve and batch)")
    bench.add_argument("--tokens", type=count, help="new tokens per prompt and stream (each benchmark has a default)")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--runs", type=count, help="interleaved repetitions (each benchmark has a default)")
    bench.add_argument("--weights", default="int4", choices=["int4", "int8", "fp16", "f32"])
    bench.add_argument("--device", default="CPU")
    bench.add_argument("--stages", type=count, help="number of pipeline stages (ksweep: 3, microbatch: 2 and 3, batch: 1 and 2, others: 2)")
    bench.add_argument("--draft", help="the draft model (default qwen2.5-coder-0.5b)")
    bench.add_argument("--draft-kind", default="model", choices=["model", "lookup", "hybrid"],
                       help="ksweep, wan, progression: what drafts")
    bench.add_argument("--spec-k", type=count, default=3, help="spec: the fixed K to compare with auto")
    bench.add_argument("--delay-ms", type=duration, default=0.0, help="pipeline, progression: one-way delay per hop")
    bench.add_argument("--delays", type=_delays, help="ksweep, microbatch, wan: the hop delays to sweep (ms, comma-separated)")
    bench.add_argument("--cpus", help="pin each stage's process to a CPU set: '0-1;2-3' (stage 0 = this process)")
    bench.add_argument("--users", type=_counts, help="serve: the concurrent users of each wave (default 1,2,4,8); batch: the stream counts (same default); "
                       "soak: the users (default 8)")
    bench.add_argument("--parts", help="serve: the parts to measure, comma-separated (default users,prefix,ttft)")
    bench.add_argument("--cases", type=count, default=10000, help="fuzz: generated cases per target (default 10000)")
    bench.add_argument("--minutes", type=duration, default=60.0, help="soak: how long the users chat (default 60)")
    bench.add_argument("--kill-every", type=duration, default=300.0,
                       help="soak: seconds between kills of the worker (default 300)")
    bench.add_argument("--json", help="write the report here")
    bench.set_defaults(func=cmd_bench)

    from engine.fleet.commands import add_commands

    add_commands(sub, _connection_args)
    from engine.clidoc import add_examples

    add_examples(parser)
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
