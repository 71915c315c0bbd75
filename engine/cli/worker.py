"""``fleet worker``: serve one shard as a stage of the pipeline, on a TCP port."""

from __future__ import annotations

import argparse
import sys

from engine.cli.args import connection_args, duration, interval, settings_of
from engine.config import FleetAccess, RelayOptions, ShardOptions
from engine.fleetkey import fleet_access
from engine.launch import lifeline, report
from engine.manifest import expand_shard_dirs, layer_span
from engine.runtime.relay.affinity import pin
from engine.runtime.decode.draftserver import DraftServer
from engine.runtime.relay.worker import TOKENS, Worker
from engine.runtime.stages.turns import compute_turns


def cmd_worker(args) -> int:
    pin(args.cpus)
    settings = settings_of(args)
    access = fleet_access(settings)
    if args.role == "draft":
        return _draft_server(args, settings, access)
    worker = Worker(args.shard, args.listen, args.next, access=access, shard=ShardOptions.of(settings, args.precision),
                    delay_ms=args.delay_ms, isolate=args.isolate_streams,
                    turns=compute_turns(args.compute_turns),
                    relay=RelayOptions(heartbeat_s=args.heartbeat),
                    counted=(lambda tokens: report(TOKENS, tokens)) if args.lifeline else None)  # to the parent
    if args.lifeline:  # only now: a thread running while OpenVINO starts can hang the child it forks
        lifeline()
    m = worker.manifest
    what = (f"tensor-parallel rank {m.rank} of {m.ranks}" if m.ranks > 1 else
            f"stage {m.stage_index} of {m.stage_count}")
    print(f"{what} ({layer_span(*m.layers)}) on "
          f"{worker.runner.device}, listening on {worker.address}"
          + (f", next stage {args.next}" if args.next else ""), file=sys.stderr, flush=True)
    print(f"ready {worker.address}", flush=True)
    worker.serve_forever()
    return 0


def _draft_server(args, settings, access: FleetAccess) -> int:
    server = DraftServer(expand_shard_dirs([args.shard]), args.listen, access=access, device=settings.device,
                         delay_ms=args.delay_ms)
    if args.lifeline:
        lifeline()
    print(f"draft model {server.manifest.model_name} on {settings.device}, listening on {server.address}",
          file=sys.stderr, flush=True)
    print(f"ready {server.address}", flush=True)
    server.serve_forever()
    return 0


def add_commands(sub) -> None:
    worker = sub.add_parser("worker", help="serve one shard as a stage of the pipeline")
    worker.add_argument("--shard", required=True, help="the shard folder this worker serves")
    worker.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any free port)")
    worker.add_argument("--next", help="HOST:PORT of the next stage (default: the coordinator names it)")
    worker.add_argument("--device", help="OpenVINO device (CPU, GPU, NPU, GPU.1...)")
    worker.add_argument("--precision", help="inference precision hint (f32, bf16, f16)")
    worker.add_argument("--mode", choices=["fast", "exact"], help="correctness mode (every stage must agree)")
    worker.add_argument("--delay-ms", type=duration, default=0.0,
                        help="add this one-way delay to every frame received and sent upstream")
    worker.add_argument("--heartbeat", type=interval, default=RelayOptions.heartbeat_s, metavar="SECONDS",
                        help="send ALIVE upstream and check the next stage's silence at least this often while a "
                             "reply is owed (default %(default)s; a tenth of a shorter --deadline)")
    worker.add_argument("--isolate-streams", action="store_true",
                        help="compile the shard once per stream instead of sharing one compiled model")
    worker.add_argument("--cpus", help="pin this worker to these CPUs (Linux; like taskset: 0-3,6)")
    worker.add_argument("--compute-turns", metavar="FILE",
                        help="compute one at a time with the other stages on this computer that name the same file")
    worker.add_argument("--role", choices=["stage", "draft"], default="stage",
                        help="'draft': serve a whole draft model that drafts ahead for a target on another computer")
    worker.add_argument("--lifeline", action="store_true", help=argparse.SUPPRESS)
    connection_args(worker)
    worker.set_defaults(func=cmd_worker)
