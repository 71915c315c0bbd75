"""``fleet bench serve``: users chatting through the official ``openai`` client against ``fleet serve``
on a pipeline of worker processes, side by side with openvino_genai.LLMPipeline behind the very same
API and harness (one request at a time, as a user of LLMPipeline would serve it).

Each wave sends one streamed request per user at once (a different prompt each, ``ignore_eos`` so
every reply has the same length) and measures at the client: aggregate tok/s (every reply's tokens
over the wave's wall time), time to first token and the gaps between streamed chunks, p50 and p95.
Waves alternate between the two servers, users 1, 2, 4, 8, ``runs`` times over.

Two more parts measure what a server's users feel most: the prefix cache (the second turn of a
long conversation, warm against cold, alternating) and prompt speed (time to first token of our
1-, 2- and 3-stage chains against LLMPipeline's on the same export and settings, at a short and a
long prompt).  With ``llamacpp`` (a GGUF source), llama.cpp's ``llama-server`` on the very GGUF
the shards came from joins the user waves (one slot per user) and the prompt-speed part (its time to
the first token, measured at the client), and, where the model has a draft model in the catalog, so does
llama.cpp with that draft (``-md``, its own speculative decoding) at 1 user: its best configuration
for one user, the faster of the two the bar; with ``llamacpp_openvino``, so does llama.cpp's OpenVINO
backend, its layers on our ``device``, as a column of its own.  Every prompt is new to every side:
LLMPipeline reuses the KV cache of an identical previous prompt, so a repeated prompt would time its
cache, not its prefill.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai

from engine.bench.harness import NO_HOOKS, PROMPTS, Hooks, genai_runner, interleave, loopback
from engine.bench.llamacpp import VERSION as LLAMACPP_VERSION
from engine.bench.llamacpp import LlamaCppUnavailable, LlamaServer, without_amx
from engine.bench.parity import llamacpp_gguf
from engine.bench.report import median, write_report
from engine.config import DEFAULT_WEIGHTS, Scheduling
from engine.errors import FleetError
from engine.export.exporter import export_model
from engine.models.catalog import draft_of
from engine.runtime.decode.generate import Generator
from engine.runtime.decode.service import ChatService, Handle, Reply
from engine.runtime.decode.tokenizer import ChatTokenizer
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import device_config
from engine.serve.server import ApiServer

USERS = (1, 2, 4, 8)
PARTS = ("users", "prefix", "ttft")
PROMPT_LENGTHS = (46, 1000)  # the parity run's prompt, and a long paste
# the llama.cpp peers: run_serve's flag -> the column's name and the llama.cpp build that serves it
PEERS = {"llamacpp": ("llama.cpp", "cpu"), "llamacpp_openvino": ("llama.cpp OpenVINO", "openvino")}
# llama.cpp with the model's draft model (the ``llamacpp`` flag, where the catalog has a draft): a
# column at 1 user only, where speculation is llama.cpp's best configuration
LLAMA_DRAFT = "llama.cpp + draft"
ONE_USER = (LLAMA_DRAFT,)


class GenaiService:
    """LLMPipeline behind the part of ``ChatService`` the API uses: requests queue and are served
    one at a time by one thread, streamed through LLMPipeline's streamer."""

    streams = 1

    def __init__(self, folder: Path, device: str = "CPU", props: dict | None = None):
        self.pipe = openvino_genai.LLMPipeline(str(folder), device, **(props or {}))
        self.tokenizer = ChatTokenizer(folder)
        self.max_length = 4096
        self._ids = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="llmpipeline", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting (the API refuses more than its limit: ``engine.serve.chat.admit``)."""
        return self._queue.qsize()

    busy = queued

    def submit(self, messages, max_new_tokens, on_text=None, on_done=None, *, chat=True, ignore_eos=False, **_):
        handle = Handle(self, next(self._ids))
        self._queue.put((handle, messages, max_new_tokens, on_text, on_done, chat, ignore_eos))
        return handle

    def _poke(self) -> None:  # a cancel is seen by the streamer at its next token
        pass

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            handle, messages, max_new_tokens, on_text, on_done, chat, ignore_eos = item
            ids = self.tokenizer.chat_ids(messages, chat).reshape(1, -1)
            config = self.pipe.get_generation_config()
            config.max_new_tokens = max_new_tokens
            config.min_new_tokens = max_new_tokens if ignore_eos else 0
            config.ignore_eos = ignore_eos
            config.do_sample = False
            config.apply_chat_template = False
            pieces: list[str] = []

            def streamer(piece: str):
                pieces.append(piece)
                if on_text:
                    on_text(piece, len(pieces))
                return openvino_genai.StreamingStatus.CANCEL if handle.cancelled else \
                    openvino_genai.StreamingStatus.RUNNING

            inputs = openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
            result = self.pipe.generate(inputs, config, streamer)
            tokens = list(result.tokens[0])
            stopped = "cancelled" if handle.cancelled else "max_tokens" if len(tokens) >= max_new_tokens else "eos"
            handle.reply = Reply("".join(pieces), tokens, int(ids.shape[1]), stopped)
            handle._done.set()
            if on_done:
                on_done(handle.reply)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(30)


def user_wave(url: str, model: str, prompts: list[str], tokens: int, *, api_key: str = "bench",
              extra: dict | None = None) -> tuple[list[dict], float]:
    """One streamed chat request per prompt, all at once; per request: TTFT, chunk gaps, tokens.
    ``extra``: more fields of the request body (a server's own options)."""
    # the OpenAI client is a test extra: only the user waves need it
    import openai

    results: list[dict] = [{} for _ in prompts]
    start = threading.Barrier(len(prompts) + 1)

    def user(i: int) -> None:
        client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=600)
        start.wait()
        sent = time.perf_counter()
        times, usage = [], None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompts[i]}], max_tokens=tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **(extra or {})})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            if chunk.usage:
                usage = chunk.usage
        results[i] = {"ttft_ms": (times[0] - sent) * 1e3 if times else None,
                      "gaps_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
                      "tokens": usage.completion_tokens if usage else 0}

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - began


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _wave_row(server: str, users: int, waves: list[tuple[list[dict], float]]) -> dict:
    requests = [r for wave, _ in waves for r in wave]
    ttfts = [r["ttft_ms"] for r in requests if r["ttft_ms"] is not None]
    gaps = [g for r in requests for g in r["gaps_ms"]]
    rates = [sum(r["tokens"] for r in wave) / wall for wave, wall in waves]
    return {"part": "users", "server": server, "users": users, "tok_s": round(median(rates), 2),
            "ttft_p50_ms": round(_percentile(ttfts, 50), 1), "ttft_p95_ms": round(_percentile(ttfts, 95), 1),
            "itl_p50_ms": round(_percentile(gaps, 50), 1), "itl_p95_ms": round(_percentile(gaps, 95), 1),
            "requests": len(requests)}


def _users_part(folders, one, model, users, tokens, runs, device, peers, hooks, log) -> tuple[list[dict], dict]:
    prompts = list(PROMPTS.values())
    rows, ratios = [], {}
    with loopback(folders) as (chain, _fleet):
        ours = ChatService(chain, scheduling=Scheduling(streams=max(users)))
        theirs = GenaiService(one, device, device_config(device))
        servers = {"fleet serve": ApiServer(ours, port=0, model_id=model).start(),
                   "LLMPipeline": ApiServer(theirs, port=0, model_id=model).start()}
        urls = {name: server.url for name, server in {**servers, **peers}.items()}
        try:
            # warm-up: a wave of every width measured, as a server that has served such waves is warm
            # (ours compiles a graph for a count of rows that recurs, llama.cpp sizes its batches)
            for name, url in urls.items():
                for n in sorted({1, *users}):
                    if n == 1 or name not in ONE_USER:
                        user_wave(url, model, [prompts[i % len(prompts)] for i in range(n)], tokens)
            def wave(key, run: int):
                name, n = key
                # every request new (neither server's cache may serve it), the same ones on both servers
                asked = [f"(request {run}.{i}) {prompts[i % len(prompts)]}" for i in range(n)]
                got = user_wave(urls[name], model, asked, tokens)
                log(f"run {run + 1}: {n} user(s) on {name}: {sum(r['tokens'] for r in got[0]) / got[1]:.1f} tok/s")
                return got

            keys = [(name, n) for n in users for name in urls if n == 1 or name not in ONE_USER]
            waves = interleave(wave, keys, runs, hooks=hooks,
                               label=lambda key: f"{key[1]} user(s) on {key[0]}")
        finally:
            for server in servers.values():
                server.stop()
            ours.close()
            theirs.close()
    for n in users:
        wave_rows = {name: _wave_row(name, n, waves[name, n]) for name in urls if (name, n) in waves}
        rows += wave_rows.values()
        ours_tok_s = wave_rows["fleet serve"]["tok_s"]
        for name in list(wave_rows)[1:]:
            ratios[f"tok/s, fleet serve / {name}, {n} user(s)"] = round(ours_tok_s / wave_rows[name]["tok_s"], 3)
        if LLAMA_DRAFT in wave_rows and "llama.cpp" in wave_rows:  # llama.cpp's best of one PC: with its draft or not
            best = max(("llama.cpp", LLAMA_DRAFT), key=lambda name: wave_rows[name]["tok_s"])
            ratios[f"tok/s, fleet serve / llama.cpp's best of one PC ({best}), {n} user(s)"] = round(
                ours_tok_s / wave_rows[best]["tok_s"], 3)
        for row in wave_rows.values():
            hooks.row(row)
    return rows, ratios


def _long_text(tokenizer: ChatTokenizer, tokens: int) -> str:
    """A user message of about ``tokens`` tokens (the prompt set, repeated)."""
    text, block = "", " ".join(PROMPTS.values())
    while tokenizer.chat_ids([{"role": "user", "content": text}]).size < tokens:
        text += block + "\n"
    return text


def _prefix_part(folders, model, runs, hooks, log) -> tuple[list[dict], dict]:
    """The second turn of a ~1,000-token conversation: warm (the stream kept the first turn's KV)
    against cold (a service with the prefix cache off, on its own fleet), alternating."""
    rows, ratios = [], {}
    with loopback(folders) as (cold_chain, _), loopback(folders) as (warm_chain, _):
        services = {"cold": ChatService(cold_chain, scheduling=Scheduling(streams=1), prefix_cache=False),
                    "warm": ChatService(warm_chain, scheduling=Scheduling(streams=1), prefix_cache=True)}
        try:
            tokenizer = ChatTokenizer(cold_chain.first_folder)
            text = _long_text(tokenizer, 1000)

            def second_turn(label: str, run: int):
                """Each run's conversation is new: a first turn, then the second whose TTFT counts."""
                first = [{"role": "user", "content": f"Run {run}.\n" + text}]
                reply = services[label].submit(first, 16, ignore_eos=True).wait()
                second = first + [{"role": "assistant", "content": reply.text},
                                  {"role": "user", "content": "Summarise that in one sentence."}]
                turn = services[label].submit(second, 4, ignore_eos=True).wait()
                log(f"prefix cache {label}: second turn TTFT {turn.ttft_ms:.0f} ms "
                    f"({turn.cached_tokens} of {turn.prompt_tokens} prompt tokens cached)")
                return turn

            turns = interleave(second_turn, services, runs, warmup=1, hooks=hooks,
                               label=lambda label: f"prefix cache, {label}")
        finally:
            for service in services.values():
                service.close()
    samples = {label: [turn.ttft_ms for turn in got] for label, got in turns.items()}
    for label, values in samples.items():
        rows.append({"part": "prefix cache", "server": label, "prompt_tokens": turns[label][-1].prompt_tokens,
                     "ttft_p50_ms": round(median(values), 1)})
        hooks.row(rows[-1])
    ratios["second-turn TTFT, cold / warm (1,000-token conversation)"] = round(
        median(samples["cold"]) / median(samples["warm"]), 2)
    return rows, ratios


def _ttft_part(exports: dict, one: Path, device: str, runs: int, peers, hooks, log) -> tuple[list[dict], dict]:
    """TTFT of our in-process chains against LLMPipeline's, same export and compile settings."""
    tokenizer = ChatTokenizer(one)
    long_ids = tokenizer.chat_ids([{"role": "user", "content": _long_text(tokenizer, max(PROMPT_LENGTHS))}])
    genai = genai_runner(one, 2, device=device, props=device_config(device))
    ours = {f"ours {n}-stage": Generator(LocalChain(folders, device=device), max_length=max(PROMPT_LENGTHS) + 8)
            for n, folders in exports.items()}
    # the stateful stages every stage ran before paged attention, side by side
    ours["ours 1-stage, stateful"] = Generator(LocalChain(exports[1], device=device, paged=False),
                                               max_length=max(PROMPT_LENGTHS) + 8)
    peer_rows = {f"{name} 1-stage": peer for name, peer in peers.items() if name not in ONE_USER}
    rows, ratios = [], {}
    for length in PROMPT_LENGTHS:
        base_ids = long_ids.reshape(-1)[-length:]  # the last tokens: the template's ending included

        def ttft_ms(name: str, run: int) -> float:
            # a new prompt every run: LLMPipeline reuses the KV of an identical previous prompt
            ids = base_ids.copy()
            ids[:2] = (100 + run, 200 + run)
            ids = ids.reshape(1, -1)
            if name == "LLMPipeline 1-stage":
                return genai(ids)[1]
            if name in peer_rows:
                sent = time.perf_counter()
                peer_rows[name].complete([int(t) for t in ids.reshape(-1)], 1)
                return (time.perf_counter() - sent) * 1e3
            return ours[name].generate(ids, 2, ignore_eos=True).ttft_s * 1e3

        samples = interleave(ttft_ms, ["LLMPipeline 1-stage", *ours, *peer_rows], runs, warmup=1, alternate=True,
                             hooks=hooks, label=lambda name: f"TTFT at {length} prompt tokens, {name}")
        base = median(samples["LLMPipeline 1-stage"])
        for name, values in samples.items():
            rows.append({"part": "ttft", "server": name, "prompt_tokens": length,
                         "ttft_p50_ms": round(median(values), 1), "vs_llmpipeline": round(median(values) / base, 3)})
            hooks.row(rows[-1])
            if name != "LLMPipeline 1-stage":
                ratios[f"TTFT {name} / LLMPipeline, {length} tokens"] = rows[-1]["vs_llmpipeline"]
        for name in (name for name in peers if name not in ONE_USER):
            ratios[f"TTFT ours 1-stage / {name}, {length} tokens"] = round(
                median(samples["ours 1-stage"]) / median(samples[f"{name} 1-stage"]), 3)
        measured = rows[-len(samples):]
        log(f"TTFT at {length} tokens: " + ", ".join(f"{r['server']} {r['ttft_p50_ms']} ms" for r in measured))
    return rows, ratios


def _start_peers(stack: contextlib.ExitStack, model: str, slots: int, device: str, asked: dict[str, bool],
                 log, one_user: bool = False) -> tuple[dict[str, LlamaServer], dict[str, str]]:
    """The llama.cpp peers asked for (``PEERS``' flags), by column name, each closed with ``stack``, and
    a note per flag for the report: what ran, or why it did not (a peer that cannot be built or
    started is left out, and the run goes on).  ``one_user``: a wave of 1 user is measured, so
    llama.cpp (asked for) runs with the model's draft too (``llamacpp_draft``'s note)."""
    peers, notes = {}, {}
    for flag, (name, backend) in PEERS.items():
        notes[flag] = "not asked for"
        if not asked.get(flag):
            continue
        try:
            peers[name] = stack.enter_context(LlamaServer(llamacpp_gguf(model), slots=slots, backend=backend,
                                                          device=device, log=log))
            notes[flag] = f"llama-server {LLAMACPP_VERSION}" + (
                f", OpenVINO backend on {device}, its graph fixed for this build (llamacpp.OPENVINO_PATCH)"
                if backend == "openvino" else "") + (
                ", built without AMX, whose kernels crash it (llamacpp.NO_AMX)" if without_amx() else "")
        except LlamaCppUnavailable as exc:
            notes[flag] = f"skipped: {exc}"
            log(f"{name} column {notes[flag]}")
    if asked.get("llamacpp") and one_user:
        notes["llamacpp_draft"] = _start_draft_peer(stack, model, peers, log)
    return peers, notes


def _start_draft_peer(stack: contextlib.ExitStack, model: str, peers: dict[str, LlamaServer], log) -> str:
    """llama.cpp with ``model``'s catalog draft (one slot: its column is 1 user), added to ``peers``;
    the report's note on it."""
    draft = draft_of(model)
    if draft is None:
        return f"not run: {model} has no draft model in the catalog"
    try:
        peers[LLAMA_DRAFT] = stack.enter_context(LlamaServer(llamacpp_gguf(model), slots=1,
                                                             draft=llamacpp_gguf(draft), log=log))
    except LlamaCppUnavailable as exc:
        log(f"{LLAMA_DRAFT} column skipped: {exc}")
        return f"skipped: {exc}"
    return (f"llama-server {LLAMACPP_VERSION} with {draft} drafting (llamacpp.draft_options, the build's "
            f"draft length), at 1 user")


def run_serve(model: str, *, stages: int = 2, users: tuple[int, ...] = USERS, tokens: int = 64, runs: int = 2,
              weights: str = DEFAULT_WEIGHTS, device: str = "CPU", parts: tuple[str, ...] = PARTS,
              llamacpp: bool = False, llamacpp_openvino: bool = False, out: Path | None = None, log=print,
              hooks: Hooks = NO_HOOKS) -> dict:
    """``parts``: which of ``users``, ``prefix`` and ``ttft`` to measure; ``llamacpp``: llama.cpp too
    (and at 1 user, llama.cpp with the model's catalog draft); ``llamacpp_openvino``: llama.cpp's
    OpenVINO backend too, on ``device``."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise FleetError(f"unknown parts {', '.join(sorted(unknown))}: the parts are {', '.join(PARTS)}")
    splits = {1, stages} | ({2, 3} if "ttft" in parts else set())  # TTFT compares 1, 2 and 3 stages
    exports = {n: export_model(model, stages=n, weights=weights, cancel=hooks.cancel).folders for n in sorted(splits)}
    one = exports[1][0]
    rows, ratios = [], {}
    with contextlib.ExitStack() as stack:
        peers, notes = _start_peers(stack, model, max(users), device,
                                    {"llamacpp": llamacpp, "llamacpp_openvino": llamacpp_openvino}, log,
                                    one_user="users" in parts and 1 in users)
        measure = {"users": lambda: _users_part(exports[stages], one, model, users, tokens, runs, device, peers,
                                                hooks, log),
                   "prefix": lambda: _prefix_part(exports[stages], model, runs, hooks, log),
                   "ttft": lambda: _ttft_part(exports, one, device, runs, peers, hooks, log)}
        for name in parts:
            more_rows, more_ratios = measure[name]()
            rows += more_rows
            ratios.update(more_ratios)
    meta = {"model": model, "stages": stages, "weights": weights, "device": device, "users": list(users),
            "new_tokens": tokens, "runs": runs, "parts": list(parts), **notes}
    return write_report("serve", rows, ratios, out, settings=meta)
