"""``fleet serve``: the OpenAI-compatible API over a chain opened like ``fleet generate``'s."""

from __future__ import annotations

import signal
import sys

from engine.config import Settings


def cmd_serve(args) -> int:
    from engine.cli import open_chain, open_drafter
    from engine.fleetkey import api_key_file, load_api_key
    from engine.runtime.decode.service import ChatService
    from engine.runtime.stages.stage import REWIND
    from engine.serve.server import ApiServer, is_loopback

    settings = Settings.load()
    host = args.host or settings.api_host
    port = settings.api_port if args.port is None else args.port
    streams = args.streams or settings.api_streams
    api_key = None
    if args.require_key or not is_loopback(host):
        api_key = load_api_key(create=True)
        print(f"clients need the API key in {api_key_file()} (`fleet key api` prints it)", file=sys.stderr)
    if _embedded(args, settings):
        chain, fleet, recover = _local_fleet(args, settings)
    else:
        chain, fleet = open_chain(args, settings)
        recover = _failover(args, settings, chain)
    try:
        drafters = open_drafter(args, settings, chain, streams)
        service = ChatService(chain, streams=streams, drafters=(lambda n: drafters) if drafters else None, k=args.k,
                              rewind=REWIND[args.mode or settings.mode], owned=[fleet] if fleet else [],
                              recover=recover)
    except BaseException:
        chain.close()
        if fleet is not None:
            fleet.close()
        raise
    try:
        model_id = args.model_id or (args.model if args.model and not args.shards else None)
        server = ApiServer(service, host, port, api_key, model_id=model_id)
        print(f"serving {server.model_id} ({service.description}) at {server.url}", file=sys.stderr)
        print(f"ready {server.url}", flush=True)
        # uvicorn shuts down gracefully on SIGTERM, then raises it again: let that end us cleanly
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server.serve_forever()  # until Ctrl-C or SIGTERM
    finally:
        service.close()
    return 0


def _embedded(args, settings: Settings) -> bool:
    """No chain named (shards, remote workers, a deployment): the default is what `fleet up` and the
    app run, the model on a local fleet of 2 or more stages whose workers a local agent keeps."""
    stages = args.stages or settings.stages
    return not (args.shards or args.remote or args.deployment or args.local_workers) and stages > 1


def _local_fleet(args, settings: Settings):
    """(chain, what to close with the service, recover): the local fleet, with failover."""
    from engine.fleet.commands import LocalAgent, local_up
    from engine.fleet.failover import Failover
    from engine.fleetkey import key_file, load_key

    path = key_file(args.fleet_key_file)
    load_key(args.fleet_key_file, create=not args.fleet_key_file)
    deployment, chain, proc = local_up(args.model or settings.default_model, args.stages or settings.stages, path,
                                       weights=settings.weights, mode=args.mode or settings.mode,
                                       device=args.device or settings.device,
                                       deadline_s=args.deadline or settings.deadline_s)
    failover = Failover(deployment, key=load_key(path), deadline_s=args.deadline or settings.deadline_s, chain=chain,
                        on_event=lambda text: print(f"fleet: {text}", file=sys.stderr, flush=True))
    return chain, LocalAgent(proc), failover.recover


def _failover(args, settings: Settings, chain):
    """A deployed fleet's recovery (``engine.fleet.failover``): replies in flight survive a lost node."""
    if not args.deployment:
        return None
    from pathlib import Path

    from engine.fleet.deploy import Deployment
    from engine.fleet.failover import Failover
    from engine.fleetkey import load_key, load_tls

    record = Deployment.load(None if args.deployment == "last" else Path(args.deployment))
    if not record.placement:
        return None
    failover = Failover.of(record, key=load_key(args.fleet_key_file), deadline_s=args.deadline or settings.deadline_s,
                           tls=load_tls(args.tls or settings.tls, args.fleet_key_file),
                           on_event=lambda text: print(f"fleet: {text}", file=sys.stderr, flush=True), chain=chain)
    return failover.recover


def add_serve_command(sub, chain_args) -> None:
    """``chain_args`` adds the options that say where the model runs (``fleet generate``'s)."""
    from engine.cliargs import count, port

    serve = sub.add_parser("serve", help="serve the model as an OpenAI-compatible HTTP API (/v1/chat/completions)")
    chain_args(serve)
    serve.add_argument("--host", help="address to listen on (default: the settings', 127.0.0.1); any other than "
                                      "loopback needs the API key")
    serve.add_argument("--port", type=port, help="port to listen on (default: the settings', 8000; 0: any free port)")
    serve.add_argument("--streams", type=count, help="replies made concurrently (default: the settings', 4); "
                                                      "more requests wait their turn")
    serve.add_argument("--model-id", help="the model name clients ask for (default: --model, else the shards' model)")
    serve.add_argument("--require-key", action="store_true", help="ask clients for the API key on loopback too")
    serve.set_defaults(func=cmd_serve)
