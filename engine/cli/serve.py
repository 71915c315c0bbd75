"""``fleet serve``: the OpenAI-compatible API over a model opened like ``fleet generate``'s chain.

With no chain named (shards, remote workers, a deployment), the model runs as the settings say:
by default the local fleet ``fleet up`` and the app run, with failover.
"""

from __future__ import annotations

import dataclasses
import signal
import sys

from engine.cli.args import chain_args, count, launch_of, port, progress_printer, say, settings_of
from engine.documents.collection import Library
from engine.fleetkey import api_key_file, load_api_key
from engine.serve.server import ApiServer, is_loopback
from engine.session import open_service


def cmd_serve(args) -> int:
    settings = settings_of(args)
    settings = dataclasses.replace(settings, streams=args.streams or settings.api_streams)
    host = args.host or settings.api_host
    port_ = settings.api_port if args.port is None else args.port
    api_key = None
    if args.require_key or not is_loopback(host):
        api_key = load_api_key(create=True)
        say(f"clients need the API key in {api_key_file()} (`fleet key api` prints it)")
    name = args.documents or settings.api_documents
    documents = Library().open(name) if name else None  # the app's Documents sidebar makes collections
    service = open_service(settings, launch_of(args, in_process=False), progress_printer(),
                           on_event=lambda text: say(f"fleet: {text}"))
    try:
        model_id = args.model_id or (args.model if args.model and not args.shards else None)
        server = ApiServer(service, host, port_, api_key, model_id=model_id, max_body_mb=settings.api_max_body_mb,
                           max_waiting=settings.api_max_waiting, documents=documents)
        if documents is not None:
            say(f"chat replies are grounded in the documents of {documents.name!r}")
        say(f"serving {server.model_id} ({service.description}) at {server.url}")
        print(f"ready {server.url}", flush=True)
        # uvicorn shuts down gracefully on SIGTERM, then raises it again: let that end us cleanly
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server.serve_forever()  # until Ctrl-C or SIGTERM
    finally:
        service.close()
    return 0


def add_commands(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model as an OpenAI-compatible HTTP API (/v1/chat/completions)")
    chain_args(serve)
    serve.add_argument("--host", help="address to listen on (default: the settings', 127.0.0.1); any other than "
                                      "loopback needs the API key")
    serve.add_argument("--port", type=port, help="port to listen on (default: the settings', 8000; 0: any free port)")
    serve.add_argument("--streams", type=count, help="replies made concurrently (default: the settings', 4); "
                                                      "more requests wait their turn")
    serve.add_argument("--model-id", help="the model name clients ask for (default: --model, else the shards' model)")
    serve.add_argument("--documents", metavar="COLLECTION",
                       help="ground chat replies in this document collection (default: the setting api_documents); "
                            "a request sends \"documents\": false to go without")
    serve.add_argument("--require-key", action="store_true", help="ask clients for the API key on loopback too")
    serve.set_defaults(func=cmd_serve)
