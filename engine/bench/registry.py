"""Every ``fleet bench`` benchmark, defined once: its name, what it measures, the options it takes
(and what each means for it), the model it runs by default, and, for those the app's Benchmarks
view offers, what the app passes and how it draws the rows.  The command line
(``engine.cli.bench``) and the app (``fleetgui.backend``, ``fleetgui.bench_panel``) read these;
the numbers an option defaults to are the run function's own.  A benchmark's module is imported
only when it runs (``Bench.run``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

SMALL_MODEL = "smollm2-135m"
TARGET_MODEL = "qwen2.5-coder-1.5b"  # the speculation and fleet benchmarks' target: it has a 0.5B draft
DRAFT_MODEL = "qwen2.5-coder-0.5b"
DELAY_AXIS = "network delay between parts (ms, one way)"


@dataclass(frozen=True)
class Plot:
    """How the app draws a benchmark's rows: ``lines`` of each ``ys`` column against ``x`` (a line per
    ``series``, a format over the row, or without it a line per ``ys`` column), or ``bars`` of the
    ``ys`` column labelled by the ``x`` column.  ``ys`` names each column as the plot shows it;
    rows holding any of ``skip`` (side-by-side comparisons) are left out."""

    kind: str
    x: str
    ys: dict[str, str]
    series: str | None = None
    x_label: str = ""
    skip: tuple[str, ...] = ()


def takes(*same: str, **renamed: str | tuple[str, Callable]) -> dict[str, tuple[str, Callable | None]]:
    """The options a benchmark takes, each as (its run function's keyword, a conversion or None):
    ``same`` by their own name, ``renamed`` as ``option="keyword"`` or ``option=("keyword", convert)``.
    Every benchmark writes its report where ``json`` says."""
    options = {"json": ("out", None), **{option: (option, None) for option in same}}
    for option, keyword in renamed.items():
        options[option] = keyword if isinstance(keyword, tuple) else (keyword, None)
    return options


def single(value) -> tuple:
    """One value as the tuple a run function takes (``--stages 2``: ``stage_counts=(2,)``)."""
    return (value,)


@dataclass(frozen=True)
class Ratio:
    """What one ratio of a report compares, for saying it in a sentence (``engine.bench.summary``):
    ``speed``: ``subject``'s speed over ``against``'s; ``cost``: what ``subject`` costs, in ms;
    ``value``: a figure said as it is.  ``when`` ends the sentence (" for 4 people at once"); each
    text may name the report's settings (``{users}``)."""

    kind: str
    subject: str
    against: str = ""
    when: str = ""


@dataclass(frozen=True)
class Bench:
    """One benchmark: ``engine.bench.<name>.run_<name>`` and what its callers need to know of it.

    ``options``: option name -> (keyword, conversion) (``takes``); an option is a ``fleet bench``
    flag's name (``draft_kind`` for ``--draft-kind``) or a value only the app gives (``shards``: its
    shard set, ``k``: its draft length).  ``notes``: what an option means for this benchmark, where
    that needs saying (the ``--help`` lists them).  ``plot``: how the app draws its rows; a
    benchmark without one is not in the app.  ``app``: what the app passes beside its options.
    ``ratios``: what its report's ratios compare, said in words (``Ratio``).  ``current``: it
    measures what the chat runs on: the app passes its deployment (or None) and its settings.
    ``group``: where the app lists it ("" first, for everyone; "Research": the paper's measurements).
    ``title``: how the app names it, by the question it answers ("": its name)."""

    name: str
    description: str
    options: dict[str, tuple[str, Callable | None]]
    model: str | None = SMALL_MODEL
    notes: dict[str, str] = field(default_factory=dict)
    plot: Plot | None = None
    app: dict = field(default_factory=dict)
    ratios: dict[str, Ratio] = field(default_factory=dict)
    current: bool = False
    group: str = "Research"
    title: str = ""

    @property
    def shown_name(self) -> str:
        """What the app calls this benchmark: its title, or its name."""
        return self.title or self.name

    def keywords(self, values: dict) -> dict:
        """The run function's keyword arguments for the option ``values`` given (None: not given):
        those this benchmark takes, renamed and converted; the model and the draft model default to
        ``model`` and ``DRAFT_MODEL``, every other option to the run function's default."""
        values = {"model": self.model, "draft": DRAFT_MODEL} | {k: v for k, v in values.items() if v is not None}
        return {keyword: convert(values[option]) if convert else values[option]
                for option, (keyword, convert) in self.options.items() if values.get(option) is not None}

    def run(self, **keywords) -> dict:
        """Runs the benchmark with these keyword arguments (``keywords``, and ``log``, ``hooks``): its report."""
        module = importlib.import_module(f"engine.bench.{self.name}")
        return getattr(module, f"run_{self.name}")(**keywords)


BENCHES = {bench.name: bench for bench in (
    Bench("fleet", "how fast is my fleet: what the chat runs on (a deployment across PCs, or the model's parts as "
          "processes on this PC) against the whole model on this PC alone, for 1 person and for several people at "
          "once",
          takes("model", "tokens", "runs", "weights", "shards", users=("users", max)),
          notes={"users": "the people at once of the second comparison (default 4)"},
          plot=Plot("bars", "config", {"tok_s": "tok/s, all people together"}),
          ratios={"fleet_vs_alone_1_user": Ratio("speed", "your fleet", "this PC alone", " for 1 person"),
                  "fleet_vs_alone_n_users": Ratio("speed", "your fleet", "this PC alone",
                                                  " for {users} people at once")},
          current=True, group="", title="How fast is my fleet?"),
    Bench("wan", "naive decode against micro-batching + speculation as the network delay grows",
          takes("model", "draft", "stages", "tokens", "runs", "draft_kind", "delays", "weights", "shards", "k",
                cpus="cpu_sets"),
          TARGET_MODEL,
          plot=Plot("lines", "delay_ms", {"naive_tok_s": "naive: 1 stream",
                                          "full_tok_s": "full stack: 2 streams + speculation"}, x_label=DELAY_AXIS)),
    Bench("ksweep", "which draft length K wins at which network delay",
          takes("model", "draft", "stages", "tokens", "draft_kind", "delays", "weights", "shards", cpus="cpu_sets"),
          TARGET_MODEL, notes={"stages": "default 3"},
          plot=Plot("lines", "delay_ms", {"tok_s": "tok/s"}, "K={k}", DELAY_AXIS)),
    Bench("microbatch", "aggregate throughput of 1, 2 and 3 concurrent streams",
          takes("model", "tokens", "runs", "delays", "weights", "shards", cpus="cpu_sets",
                stages=("stage_counts", single)),
          TARGET_MODEL, notes={"stages": "default 2 and 3"},
          plot=Plot("lines", "delay_ms", {"tok_s": "tok/s"}, "{stages} parts, {streams} streams", DELAY_AXIS,
                    skip=("isolation", "turns")),  # microbatch.COMPARISONS' rows
          app={"isolation": False, "turns": False}),
    Bench("progression", "monolithic → pipeline → + micro-batching → + speculation",
          takes("model", "draft", "stages", "tokens", "runs", "draft_kind", "delay_ms", "weights", "shards",
                cpus="cpu_sets"),
          TARGET_MODEL, plot=Plot("bars", "config", {"tok_s": "tok/s"})),
    Bench("pipeline", "what the network between parts costs against the same parts in one process",
          takes("model", "stages", "tokens", "warmup", "runs", "delay_ms", "weights", "shards"),
          plot=Plot("bars", "config", {"tok_s": "tok/s"}),
          ratios={"tcp_vs_inprocess": Ratio("speed", "the split model with its parts talking over the network "
                                            "(loopback)", "the same parts in one process"),
                  "split_vs_whole": Ratio("speed", "the model split into parts", "the whole model, in one process"),
                  "loopback_extra_ms_per_hop": Ratio("cost", "each network hop between parts", when=" per token"),
                  "network_ms_per_hop": Ratio("cost", "waiting on the network", when=" per hop and token"),
                  "relay_round_trip_ms_per_hop": Ratio("cost", "a message down the chain and back",
                                                       when=" per hop (no compute)")}),
    Bench("ahead", "one user on a pipeline: speculation that sends the next round while one is verified "
          "(speculating ahead, PipeInfer's early speculation) against a round at a time and the whole model",
          takes("model", "draft", "stages", "tokens", "runs", "draft_kind", "mode", "delay_ms", "weights", "shards",
                spec_k="k", cpus="cpu_sets"),
          notes={"draft_kind": "lookup for a model no smaller one shares a tokenizer with",
                 "spec_k": "the drafts per round (default 3)",
                 "cpus": "one CPU set per part, as if each had its own PC: '0;1' (unpinned, the parts take turns)"}),
    Bench("tls", "what mutual TLS costs: the same loopback fleet with it and without, interleaved (decode and "
          "prefill tok/s)", takes("model", "stages", "tokens", "warmup", "runs", "weights", "shards"),
          ratios={"decode_tls_vs_plain": Ratio("speed", "answering over TLS", "the same fleet without it"),
                  "prefill_tls_vs_plain": Ratio("speed", "reading the prompt over TLS", "the same fleet without it"),
                  "ping_extra_ms": Ratio("cost", "TLS", when=" a trip down the chain and back")}),
    Bench("parity", "our chains of parts against OpenVINO GenAI's LLMPipeline (needs a catalog or model source)",
          takes("model", "tokens", "warmup", "runs", "device", "weights", "head", "llamacpp"),
          plot=Plot("bars", "config", {"tok_s": "tok/s"})),
    Bench("spec", "speculative decoding against the target alone (needs a draft model)",
          takes("model", "draft", "tokens", "runs", "weights", spec_k="k"),
          TARGET_MODEL, plot=Plot("bars", "prompt", {"target_tok_s": "target alone, tok/s"})),
    Bench("sim", "what loopback cannot measure, on a simulated office of one-core PCs: deploying and a cable cut, "
          "one PC against two (ours and llama.cpp's split), a model too big for one PC, a slow PC, a PC that "
          "drafts, tensor-parallel ranks, the solver's layout; the app runs the office part, at 1-8 users "
          "(needs root for its network namespaces, a GGUF model, and builds llama.cpp once)",
          takes("model", "draft", "tokens", "runs", "users", "parts", "weights", memory="memory_mb"),
          notes={"users": "the users of each wave (default 1,2,4,8; the draft part: 1,2,4; the ranks part: 1; the "
                          "layout part: its offices with any of them, default all)",
                 "parts": "links,office,big,slow,draft,ranks,layout (default all)",
                 "memory": "each PC's memory cap in the part with a model too big for one (default 1000)"},
          plot=Plot("lines", "users", {"tok_s": "tok/s"}, "{server}", "users at once"),
          app={"parts": ("office",)}),
    Bench("placement", "whether the placement solver's cost model predicts what a split does here",
          takes("model", "tokens", "runs", "weights")),
    Bench("serve", "users chatting through the OpenAI API against fleet serve, beside LLMPipeline behind the same "
          "API", takes("model", "stages", "tokens", "runs", "users", "parts", "device", "weights", "llamacpp",
                       "llamacpp_openvino"),
          TARGET_MODEL,
          notes={"users": "the concurrent users of each wave (default 1,2,4,8)",
                 "parts": "users,prefix,ttft (default all)"}),
    Bench("batch", "many users on one part: one forward per stream against packed paged attention and "
          "OpenVINO's ContinuousBatchingPipeline",
          takes("model", "tokens", "runs", "device", "weights", stages=("stage_counts", single), users="streams"),
          TARGET_MODEL, notes={"stages": "default 1 and 2", "users": "the stream counts (default 1,2,4,8)"}),
    Bench("quality", "how faithful each weight format's shards are to the source's own weights (KL divergence, "
          "HumanEval)",
          takes("model", "tokens", "device", "parts", "cases", "text", "llamacpp", stages=("stages", single),
                formats="weights"),
          notes={"stages": "default 1 and 2", "parts": "kl,humaneval (default kl)",
                 "cases": "HumanEval problems, evenly spaced over the 164 (default all)"}),
    Bench("profile", "where a decode round's time goes, per kind of graph node and outside the graph",
          takes("model", "tokens", "runs", "users", "device", "weights", "mode", "llamacpp", memory="memory_mb",
                kernels="paths"),
          TARGET_MODEL,
          notes={"users": "the user counts (default 1,4)",
                 "memory": "the MB of weights the memory-speed row reads (default 400)"}),
    Bench("fuzz", "hostile input against every surface a peer or a client reaches (Hypothesis)",
          takes("model", "cases", "weights"),
          notes={"cases": "generated cases per target (default 10000)"}),
    Bench("soak", "users chatting for a long time while the fleet under them loses its worker again and again",
          takes("model", "stages", "tokens", "minutes", "weights", kill_every="kill_every_s", users=("users", max)),
          notes={"users": "the users (default 32)"}),
    Bench("docs", "document search's recall on the shipped question set (no model)", takes(), model=None),
    Bench("kernels", "our kernels alone on one thread, Q4_K and Q6_K matrices of a 1.5B model against 1-8 rows "
          "of x, beside ggml's (no model; needs the kernel extension and AVX2)", takes("runs", "users"), model=None,
          notes={"users": "the rows of x (default 1,2,4,8)"}),
)}
