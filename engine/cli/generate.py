"""``fleet generate``: text through a chain of shards, a chat on the terminal or prompts in a batch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.cli.args import chain_args, count, launch_of, progress_printer, settings_of
from engine.errors import FleetError
from engine.runtime.decode.generate import Generator, generate_streams
from engine.runtime.decode.sampling import SamplingParams
from engine.runtime.decode.tokenizer import ChatTokenizer, TextStream
from engine.runtime.stages.stage import REWIND
from engine.session import draft_shards, drafter_factory, open_chain


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
    drafts = draft_shards(settings, progress)
    opened = open_chain(settings, launch, progress)
    chain = opened.chain
    try:
        tokenizer = ChatTokenizer(chain.first_folder)
        factory = drafter_factory(settings.draft, chain, drafts, settings.device)
        drafters = factory(streams) if factory else None
        if streams > 1:
            results = _stream_batch(args, settings, chain, tokenizer, prompts, streams, drafters)
        else:
            gen = Generator(chain, max_length=chain.spec.max_position, eos_ids=chain.manifest.eos_token_ids,
                            rewind=args.rewind)
            results = _chat_loop(args, settings, tokenizer, gen, prompts, drafters[0] if drafters else None)
    finally:
        opened.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _stream_batch(args, settings, chain, tokenizer, prompts, streams, drafters) -> list[dict]:
    """Micro-batching: prompts in rounds of ``streams`` concurrent streams."""
    results = []
    for start in range(0, len(prompts), streams):
        batch = prompts[start : start + streams]
        ids = [tokenizer.prompt_ids(p, system=args.system, chat=not args.no_chat) for p in batch]
        gens, wall = generate_streams(chain, ids, settings.max_new_tokens,
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


def _chat_loop(args, settings, tokenizer, gen, prompts, drafter) -> list[dict]:
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
            ids, settings.max_new_tokens, ignore_eos=args.ignore_eos,
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
