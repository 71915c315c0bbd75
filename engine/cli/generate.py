"""``fleet generate``: text through a chain of shards, a chat on the terminal or prompts in a batch.

A chain that can fail over (a deployment: what ``fleet up`` chats on) runs under the chat service
the API server and the app use (``engine.session.open_service``), so a worker or node lost
mid-reply is recovered and the reply carries on; any other chain runs under a ``Generator``, which
reports the per-stage time breakdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.cli.args import chain_args, count, launch_of, progress_printer, reply_text, say, settings_of
from engine.config import Scheduling
from engine.errors import ContextError, FleetError
from engine.runtime.decode.generate import Generator, generate_streams
from engine.runtime.decode.sampling import SamplingParams
from engine.runtime.decode.tokenizer import ChatTokenizer, TextStream
from engine.runtime.stages.stage import REWIND
from engine.session import chain_kind, draft_shards, drafter_factory, open_chain, open_draft_link, open_service

FAILOVER_KINDS = ("deployment", "local-fleet")  # the chains ``open_service`` gives failover


def cmd_generate(args) -> int:
    settings = settings_of(args)
    prompts = list(args.prompt or [])
    if args.prompts:
        try:
            prompts += [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise FleetError(f"cannot read --prompts {args.prompts}: {exc.strerror}") from None
    streams = args.streams or 1
    args.rewind = args.rewind or REWIND[settings.mode]
    if streams > 1 and not prompts:
        raise FleetError("--streams needs prompts (--prompt repeated or --prompts FILE)")
    args.sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.repetition_penalty, args.seed)
    progress = progress_printer()
    launch = launch_of(args, in_process=True)
    through = _through_service if chain_kind(settings, launch) in FAILOVER_KINDS else _through_generator
    results = through(args, settings, launch, prompts, streams, progress)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _through_generator(args, settings, launch, prompts, streams, progress) -> list[dict]:
    """The prompts (``streams`` at a time, micro-batched) or the terminal chat on the chain itself,
    scheduled as the settings say (``Scheduling``)."""
    scheduling = dataclasses.replace(Scheduling.of(settings), streams=streams)
    drafts = draft_shards(settings, progress)
    opened = open_chain(settings, launch, progress)
    chain = opened.chain
    try:
        tokenizer = ChatTokenizer(chain.first_folder)
        remote = open_draft_link(settings, chain, opened.deployment)
        if remote is not None:
            opened.owned.append(remote)
        factory = drafter_factory(settings.draft, chain, drafts, settings.device, remote=remote)
        drafters = factory(streams) if factory else None
        if streams > 1:
            return _stream_batch(args, settings, scheduling, chain, tokenizer, prompts, drafters)
        gen = Generator(chain, max_length=chain.spec.max_position, eos_ids=chain.manifest.eos_token_ids,
                        rewind=args.rewind, scheduling=scheduling)
        return _chat_loop(prompts, _generator_reply(args, settings, tokenizer, gen, drafters[0] if drafters else None))
    finally:
        opened.close()


def _stream_batch(args, settings, scheduling, chain, tokenizer, prompts, drafters) -> list[dict]:
    """Micro-batching: the prompts in rounds of as many concurrent streams as ``scheduling`` has."""
    streams, results = scheduling.streams, []
    for start in range(0, len(prompts), streams):
        batch = prompts[start : start + streams]
        ids = [tokenizer.prompt_ids(p, system=args.system, chat=not args.no_chat) for p in batch]
        gens, wall = generate_streams(chain, ids, settings.max_new_tokens,
                                      max_length=chain.spec.max_position, eos_ids=chain.manifest.eos_token_ids,
                                      ignore_eos=args.ignore_eos, rewind=args.rewind,
                                      drafters=drafters[: len(batch)] if drafters else None, scheduling=scheduling,
                                      sampling=args.sampling)
        total = sum(len(g.tokens) for g in gens)
        for i, (prompt, g) in enumerate(zip(batch, gens)):
            text = tokenizer.decode(g.tokens)
            print(f"--- stream {i} ({len(g.tokens)} tokens, {g.decode_tok_s:.1f} tok/s"
                  + (f", acceptance {g.acceptance:.2f}" if g.drafted else "") + f")\n{reply_text(text)}")
            results.append({"stream": i, "prompt": prompt, "text": text, "tokens": g.tokens, **g.to_json()})
        print(f"[{len(batch)} streams, {total} tokens in {wall:.2f} s: {total / wall:.1f} tok/s aggregate]",
              file=sys.stderr)
    return results


def _through_service(args, settings, launch, prompts, streams, progress) -> list[dict]:
    """The prompts (``streams`` at a time) or the terminal chat under the chat service, with
    failover; what happens to the fleet is said on stderr."""
    service = open_service(dataclasses.replace(settings, streams=streams), launch, progress,
                           on_event=lambda text: say(f"fleet: {text}"))
    service.rewind = args.rewind  # before any stream starts: each stream's KV is made on its first use
    try:
        if streams == 1:
            def reply(prompt: str) -> dict:
                done = _submit(args, settings, service, prompt, echo=True).wait()
                print()
                return _reported(prompt, done)

            return _chat_loop(prompts, reply)
        results = []
        for start in range(0, len(prompts), streams):
            batch = prompts[start:start + streams]
            handles = [_submit(args, settings, service, prompt) for prompt in batch]
            for i, (prompt, handle) in enumerate(zip(batch, handles)):
                done = handle.wait()
                print(f"--- stream {i}\n{reply_text(done.text)}")
                results.append(_reported(prompt, done))
        return results
    finally:
        service.close()


def _submit(args, settings, service, prompt: str, echo: bool = False):
    """Submits ``prompt`` to the chat service (its reply shown as it comes when ``echo``); returns its handle."""
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}]
    size = int(service.tokenizer.chat_ids(messages, not args.no_chat).size)
    if size >= service.max_length:  # in the Generator's words
        raise ContextError(f"the prompt ({size} tokens) leaves no room in the context of {service.max_length}")
    return service.submit(messages, min(settings.max_new_tokens, service.max_length - size),
                          (lambda piece, _tokens: print(reply_text(piece), end="", flush=True)) if echo else None,
                          chat=not args.no_chat, ignore_eos=args.ignore_eos, sampling=args.sampling, fit="refuse")


def _reported(prompt: str, reply) -> dict:
    """A chat service's finished ``reply`` to ``prompt``, its numbers said on stderr; its error raised."""
    if reply.error:
        raise FleetError(reply.error)
    spec = f", acceptance {reply.acceptance:.2f}" if reply.drafted else ""
    moved = f", carried on over a new chain {reply.rerouted}x" if reply.rerouted else ""
    print(f"[{len(reply.tokens)} tokens, {reply.decode_tok_s:.1f} tok/s, first token {reply.ttft_ms:.0f} ms{spec}"
          f"{moved}, stopped by {reply.stopped_by}]", file=sys.stderr)
    return {"prompt": prompt, "text": reply.text, "tokens": reply.tokens, "rerouted": reply.rerouted,
            **reply.to_json()}


def _generator_reply(args, settings, tokenizer, gen, drafter):
    """A function of a prompt that generates the reply with ``gen``, shows it as it comes and returns
    its result."""

    def reply(prompt: str) -> dict:
        ids = tokenizer.prompt_ids(prompt, system=args.system, chat=not args.no_chat)
        stream = TextStream(tokenizer)
        result = gen.generate(
            ids, settings.max_new_tokens, ignore_eos=args.ignore_eos,
            on_token=lambda t: print(reply_text(stream.push(t)), end="", flush=True), drafter=drafter,
            sampling=args.sampling,
        )
        print(reply_text(stream.flush()))  # the end of the reply, held back while a character was incomplete
        spec = f", acceptance {result.acceptance:.2f}" if result.drafted else ""
        print(f"[{len(result.tokens)} tokens, {result.decode_tok_s:.1f} tok/s, "
              f"first token {result.ttft_s * 1e3:.0f} ms{spec}, stopped by {result.stopped_by}]", file=sys.stderr)
        return {"prompt": prompt, "text": tokenizer.decode(result.tokens), "tokens": result.tokens,
                **result.to_json()}

    return reply


def _chat_loop(prompts, reply) -> list[dict]:
    """The given prompts, or a chat on the terminal (one prompt from a pipe), each answered by ``reply``."""
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
        results.append(reply(prompt))
        if interactive and not sys.stdin.isatty():
            break
    return results


def add_commands(sub) -> None:
    gen = sub.add_parser("generate", help="generate text through a chain of shards")
    chain_args(gen)
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


def chat(*argv: str) -> int:
    """``fleet generate ARGV``: the terminal chat ``fleet up`` hands over to."""
    parser = argparse.ArgumentParser(prog="fleet")
    add_commands(parser.add_subparsers(dest="cmd", required=True))
    return cmd_generate(parser.parse_args(["generate", *argv]))
