"""``fleet agent``, ``nodes``, ``profile``, ``place``, ``deploy`` and ``up``: the fleet's operations.

Each ``cmd_*`` is a thin layer over ``engine.fleet``, which the app drives the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from engine.cli.args import connection_args, count, duration, printable, progress_printer, say, settings_of
from engine.cli.generate import chat
from engine.config import (DEFAULT_WEIGHTS, FleetAccess, Settings, ShardOptions, forget_nodes, known_nodes, paths,
                           remember_nodes)
from engine.errors import FleetError
from engine.export.compress import WEIGHT_FORMATS
from engine.files import write_json
from engine.fleet.agent import Agent
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.demo import MAX_NODES, demo_profile, demo_up
from engine.fleet.deploy import Deployment, deploy_draft, deploy_layout
from engine.fleet.discovery import browse
from engine.fleet.unicast import AGENT_PORT, Discovery, join, join_code, scan
from engine.fleet.local_agent import local_up, stop_local_agent
from engine.fleet.sim.netns import require_root
from engine.fleet.node import KERNEL_PATHS, SimulatedDevice, node_id, runs_slowly
from engine.fleet.layout import fastest_for_one, price_layout, solve_layout
from engine.fleet.placement import Pin, PlacementError, left_out, solve
from engine.fleet.plans import layout_stages, planned_by
from engine.fleet.shardstore import pruned_text
from engine.fleet.sim.office import NodeSpec, Office, clean_leftovers
from engine.fleet.survey import FORMER_HERE, HERE, load_survey, readable, recent_survey, survey
from engine.fleetkey import access_of, fleet_access, fleet_id, load_key
from engine.hostcpu import SLOW
from engine.launch import lifeline
from engine.manifest import layer_span, part_name
from engine.transport.link import parse_address

PLAN_CONTEXT = 4096  # the context a profile plans the KV cache for, unless told


def cmd_agent(args) -> int:
    settings = settings_of(args)
    agent = Agent(args.listen, access=fleet_access(settings), name=args.name,
                  store=Path(args.store) if args.store else None, advertise=not args.no_mdns, log=say,
                  simulate=SimulatedDevice.from_json(args.simulate) if args.simulate else None,
                  link_delay_ms=args.link_delay_ms)
    if args.lifeline:  # only now: a thread running while OpenVINO starts can hang the child it forks
        lifeline()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    say(f"node agent {agent.name} of fleet {agent.fleet_id} listening on {agent.host}:{agent.port}"
        + ("" if args.no_mdns else ", advertised over mDNS"))
    print(f"ready {agent.address}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        agent.stop()  # workers stopped, mDNS goodbye sent, connections closed
    # Exit now: at interpreter shutdown multiprocessing joins a child forked behind our back (seen after
    # OpenVINO's device queries), which can hang; everything the agent holds is already released.
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)


def _static_status(address: str, access: FleetAccess) -> dict:
    try:
        with ControlClient(address, access, timeout_s=5) as agent:
            status = agent.status()
            return {**status["node"], "addresses": [address.rpartition(":")[0]], "status": status["state"],
                    "source": "address", "address": address}
    except AgentError as exc:
        return {"address": address, "source": "address", "status": "unreachable", "error": str(exc)}


def _row(node: dict) -> str:
    """A node's line in ``fleet nodes``: what the node says of itself, made printable."""
    devices = ",".join(str(d.get("name", "?")) for d in node.get("devices", []))
    where = node.get("address") or f"{(node.get('addresses') or ['?'])[0]}:{node.get('port', '?')}"
    name = str(node.get("name", "?")) + (" (simulated)" if node.get("simulated") else "")
    note = node.get("error") or (SLOW if runs_slowly(node.get("int8_dot", ""), node.get("kernels", "")) else "")
    kernels = KERNEL_PATHS.get(node.get("kernels", ""), "?")
    name, where, status, os_name, devices, note = map(printable, (name, where, node.get("status", "?"),
                                                                  node.get("os", ""), devices, note))
    return (f"{name:<20} {where:<22} {status:<16} {os_name:<14} "
            f"{devices:<14} {kernels:<16} {node.get('memory_mb', 0) / 1024:.1f} GB  {note}")


NODES_HEADER = f"{'name':<20} {'agent':<22} {'status':<16} {'OS':<14} {'devices':<14} {'kernels':<16} memory"


def cmd_nodes(args) -> int:
    settings = settings_of(args)
    if args.nodes_cmd in ("join-code", "join", "scan", "why"):
        return _unicast(args, settings)
    if args.nodes_cmd in ("add", "remove"):
        parse_address(args.address)
        if args.nodes_cmd == "add":
            remember_nodes([args.address], by_hand=True)
        else:  # however it was added: by hand, from a join code or a scan
            forget_nodes([args.address])
        nodes = known_nodes(by_hand=True)
        say(f"{'added' if args.nodes_cmd == 'add' else 'removed'} {args.address}; nodes by address: "
            f"{', '.join(nodes) or 'none'}")
        return 0
    access = fleet_access(settings)
    if args.nodes_cmd == "prune":
        with ControlClient(args.address, access) as agent:
            done = agent.call("prune")
        say(f"removed {pruned_text(len(done['dropped']), done['unfinished'])}, {done['bytes'] / 2**20:.1f} MB, "
            f"from {args.address}; {done['kept']} served shard(s) kept")
        return 0

    def show(kind: str, info) -> None:
        if args.json:
            print(json.dumps({"event": kind, **dataclasses.asdict(info)}), flush=True)
        else:
            print(f"{kind:<8} {_row({**dataclasses.asdict(info), 'source': 'mdns'})}", flush=True)

    with Discovery(access, on_event=show if args.watch else None) as browser:
        found = [_static_status(a, access) for a in known_nodes(settings, by_hand=True)]
        if args.watch:
            if not args.json:
                print(f"{'event':<8} {NODES_HEADER}", flush=True)
            for node in found:
                print(json.dumps({"event": "added", **node}) if args.json else f"added    {_row(node)}", flush=True)
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                return 0
        browser.wait(args.seconds)
        sources = browser.sources()
        heard = [{**dataclasses.asdict(n), "source": "+".join(sources.get(n.node_id, ["mdns"]))}
                 for n in browser.nodes().values()]
        known = {n.get("node_id") for n in heard}
        nodes = heard + [n for n in found if n.get("node_id") not in known or not n.get("node_id")]
        why = browser.diagnose() if not nodes and not args.json else None
    if args.json:
        print(json.dumps(nodes, indent=2))
    elif not nodes:
        say("no nodes found. " + " ".join(printable(line) for line in why.lines) if why and why.lines else
            "no nodes found (start `fleet agent` on the other PCs; where multicast does not pass, paste this "
            "fleet's join code there (`fleet nodes join-code`), or add them with `fleet nodes add HOST:PORT`)")
    else:
        print(NODES_HEADER)
        for node in nodes:
            print(_row(node))
    return 0


def _unicast(args, settings) -> int:
    """``fleet nodes join-code``, ``join CODE``, ``scan`` and ``why``: the ways that need no multicast."""
    access = fleet_access(settings)
    if args.nodes_cmd == "join-code":
        print(join_code(access.key, port=args.port))
        say("paste it on the other PCs of the fleet: the Fleet view's \"Join code…\", or `fleet nodes join CODE`")
        return 0
    if args.nodes_cmd == "join":
        code, reached = join(args.code, access)
        for r in reached:
            said = f"{printable(r.name)} ({r.node_id}) proved the fleet key" if r.proved else \
                f"{r.outcome}: {printable(r.reason)}"
            say(f"{r.address}: {said}")
        say(f"added {', '.join(code.agents)} to the known nodes; "
            + ("the node counts from now on" if any(r.proved for r in reached) else
               "none answers now; the node counts once its agent answers and proves the fleet key"))
        return 0 if any(r.proved for r in reached) else 1
    if args.nodes_cmd == "scan":
        done = scan(access, port=args.port, deadline_s=args.seconds)
        for r in done.found:
            say(f"{r.address}: {printable(r.name)} ({r.node_id}) proved the fleet key")
        note = f"; ran out of time after {done.dialled} of {done.planned} addresses" if done.cut_short else ""
        say(f"scanned {', '.join(done.networks) or 'no network'} on port {args.port}: {len(done.found)} node(s) "
            f"found{', added to the known nodes' if done.found else ''}{note}")
        return 0
    with Discovery(access) as browser:
        browser.wait(args.seconds)
        why = browser.diagnose()
    if args.json:
        print(json.dumps({"found": why.found, "codes": why.codes, "lines": why.lines}, indent=2))
    else:
        say(f"{why.found} node(s) of other PCs found. " + (" ".join(printable(line) for line in why.lines) or
                                          "Nothing stands in the way of discovery."))
    return 0


def _agent_addresses(args, access: FleetAccess) -> list[str]:
    """--nodes: 'all' (the mDNS records whose agents prove the fleet key and their node id, plus the
    nodes added by address that answer: a PC switched off or a bogus record is left out, said) or a
    comma-separated HOST:PORT list (each must answer)."""
    if args.nodes and args.nodes != "all":
        return [a.strip() for a in args.nodes.split(",") if a.strip()]
    with Discovery(access) as browser:
        browser.wait(args.seconds)
        heard, skipped = browser.nodes().values(), browser.rejected()
    for name, reason in skipped.items():
        say(f"left out mDNS record {name.split('._', 1)[0]!r}: {reason}")
    found = [f"{n.addresses[0]}:{n.port}" for n in heard if n.addresses]
    for address in [a for a in known_nodes(by_hand=True) if a not in found]:
        status = _static_status(address, access)
        if "error" in status:
            say(f"left out {address} (added by address): {status['error']}")
        else:
            found.append(address)
    return found


def _survey(model: str, agents: list[str], *, access: FleetAccess, devices: str, weights: str, context: int,
            streams: int, out: str | None = None, reuse: bool = False) -> Path:
    """Profiles this machine and ``agents`` (``engine.fleet.survey``) and writes the profile; with
    ``reuse``, a recent profile of the same fleet at the same path stands instead."""
    asked = dict(model=model, agents=agents, access=access, local_node=node_id(),
                 local_devices=[d.strip() for d in devices.split(",")], weights=weights, context=context,
                 streams=streams)
    path = Path(out) if out else paths().data / "fleet-profile.json"
    doc = recent_survey(path, **asked) if reuse else None
    if doc:
        minutes = (time.time() - doc["taken"]["at"]) / 60
        say(f"using the fleet profile of {minutes:.0f} min ago in {path} (--resurvey profiles the fleet afresh)")
    else:
        doc = survey(**asked, progress=progress_printer())
        write_json(path, doc)
        say(f"fleet profile written to {path}")
    for d in doc["fleet"]["devices"]:
        print(f"{printable(doc['nodes'][d['node']]['name']):<20} {printable(d['device']):<8} "
              f"layer {d['layer_ms']:.3f} ms  "
              f"head {d['head_ms']:.3f} ms  call {d.get('call_ms', 0):.3f} ms  "
              f"memory {d['memory_bytes'] / 2**30:.1f} GB  {'supported' if d['supported'] else 'UNSUPPORTED'}")
    return path


@contextlib.contextmanager
def _fleets_key(nodes, doing: str):
    """Around reading the fleet key for ``doing``: with ``nodes`` named, a missing key says that it
    needs the fleet's own (the nodes refuse any other, so none is made for them)."""
    try:
        yield
    except FleetError as exc:
        if nodes:
            raise FleetError(f"{doing} needs the fleet's key: {exc}") from None
        raise


def cmd_profile(args) -> int:
    """``fleet profile``: measures this PC, and with ``--nodes`` the fleet's nodes, for the solver.  This PC
    alone makes the default key if it is missing, as a local fleet does.  The nodes need the fleet's
    own key (they refuse any other, so a new one would only fail later, node by node): a missing one
    is refused at once, by name, and none is made (nor ever a key file the settings name)."""
    settings = settings_of(args)
    with _fleets_key(args.nodes, "profiling the fleet's nodes"):
        access = fleet_access(settings, create=not args.nodes)
    _survey(settings.default_model, _agent_addresses(args, access) if args.nodes else [], access=access,
            devices=settings.device, weights=args.weights, context=args.context,
            streams=args.streams, out=args.out)
    return 0


def _pin(text: str):
    """``NODE:A-B[:DEVICE]``: layers A to B, both included (as every range is shown), or ``NODE:A``."""
    try:
        node, rng, *device = text.split(":")
        first, last = (int(x) for x in rng.split("-")) if "-" in rng else (int(rng),) * 2
        if len(device) > 1 or first > last:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pin takes NODE:FIRST-LAST[:DEVICE] (layers FIRST to LAST, "
                                         f"both included), not {text!r}") from None
    return Pin(node=node, start=first, end=last + 1, device=device[0] if device else None)


def _place(profile: Path, *, objective: str, users: int, pins, out: str | None = None,
           replicas: bool = True) -> tuple[dict, Path]:
    """Solves the placement for a profile, prints why, and writes the plan document.  For several
    users (throughput, no pins) the solver may choose copies of the model (``engine.fleet.layout``)
    unless ``replicas`` is off."""
    shape, nodes, fleet = load_survey(profile)
    names = {n: info.get("name", n) for n, info in nodes.items()}
    pins = [p if p.node in nodes else _resolve_pin(p, names) for p in pins]
    try:
        if objective == "throughput" and not pins:
            layout = solve_layout(shape, fleet, users=users, replicas=replicas)
        else:
            plan = solve(shape, fleet, objective=objective, users=users, pins=pins)
            if objective == "latency" and not pins:
                plan = fastest_for_one(shape, fleet, plan)
            layout = price_layout(shape, fleet, [plan], users)
    except PlacementError as exc:
        raise FleetError(readable(str(exc), nodes)) from None
    plan, *others = layout.plans
    print(printable(readable(layout.explain(), nodes), lines=True))
    used = {s.node for p in layout.plans for s in p.stages}
    for node, reason in left_out(shape, fleet, plan).items():
        if node not in used:
            print(printable(readable(f"  left out: {node}: {reason}", nodes)))
    doc = {"plan": plan.to_json(), "replicas": [p.to_json() for p in others], "nodes": nodes,
           "profile": str(Path(profile).resolve())}
    path = write_json(Path(out) if out else paths().data / "plan.json", doc)
    return doc, path


def cmd_place(args) -> int:
    doc, path = _place(Path(args.profile) if args.profile else paths().data / "fleet-profile.json",
                       objective=args.objective, users=args.users, pins=args.pin or [], out=args.out,
                       replicas=not args.one_chain)
    say(f"plan written to {path}; deploy it with `fleet deploy --model {doc['plan']['model']} --plan {path}`")
    return 0


def _resolve_pin(pin, names: dict):
    """A pin may name a node by its display name (the coordinator by its former name too, where no
    node has that name)."""
    matches = [n for n, name in names.items() if name == pin.node]
    if not matches and pin.node in FORMER_HERE:
        matches = [n for n, name in names.items() if name == HERE]
    if len(matches) != 1:
        raise FleetError(f"--pin names {pin.node!r}, which is not one node of the profile "
                         f"({', '.join(names.values())})")
    return dataclasses.replace(pin, node=matches[0])


def cmd_deploy(args) -> int:
    settings = settings_of(args)
    access = fleet_access(settings)
    if args.stop:
        record = Deployment.load(Path(args.record) if args.record else None)
        problems = record.stop(access)
        for p in problems:
            say(f"warning: {p}")
        workers = sum(len(copy.workers) for copy in record.copies)
        say(f"stopped {workers - len(problems)} of {workers} workers")
        return 0
    if not (args.model and args.plan):
        raise FleetError("fleet deploy needs --model and --plan (or --stop)")
    try:
        plan_doc = json.loads(Path(args.plan).read_text())
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read the plan {args.plan}: {exc}") from None
    if args.draft_on and not (args.draft_model or settings.draft_model):
        raise FleetError("--draft-on needs the draft model: --draft-model MODEL (one with the target's tokenizer)")
    deployment, chains = deploy_layout(args.model, layout_stages(plan_doc), access=access,
                                       shard=ShardOptions(weights=args.weights, mode=settings.mode),
                                       progress=progress_printer(), planned=planned_by(plan_doc),
                                       standbys=settings.standbys)
    for chain in chains:
        chain.close()
    if args.draft_on:
        try:
            deployment.draft = deploy_draft(args.draft_model or settings.draft_model, args.draft_on, access=access,
                                            weights=args.weights, progress=progress_printer())
        except BaseException:
            deployment.stop(access)
            raise
        say(f"draft server at {deployment.draft['address']}: chat with --draft remote: to draft there")
    path = deployment.save(Path(args.record) if args.record else None)
    print(f"deployed {args.model}: {_where(deployment)}")
    say(f"deployment recorded in {path}; chat with `fleet generate --deployment`; stop with `fleet deploy --stop`")
    return 0


def cmd_up(args) -> int:
    settings = settings_of(args)
    with _fleets_key(args.nodes, "placing the model on the fleet's nodes"):  # a new key for a local fleet only
        key = load_key(args.fleet_key_file, create=not args.nodes)
    model = settings.default_model
    if args.demo:
        return _demo_up(args, settings, model)
    if args.nodes:
        return _fleet_up(args, settings, model)
    peers = [] if args.local else browse(args.seconds, fleet_id(key))
    if peers:
        say(f"found {len(peers)} node(s) of this fleet: {', '.join(p.name for p in peers)}. `fleet up` runs "
            "the local default; `fleet up --nodes all` places the model on them")
    deployment, chain, agent = local_up(model, settings.stages, access=fleet_access(settings),
                                        shard=ShardOptions.of(settings), progress=progress_printer())
    chain.close()
    try:
        return _serve(args, model, deployment, settings.tls)
    finally:
        stop_local_agent(agent)


def _fleet_up(args, settings: Settings, model: str) -> int:
    """``fleet up --nodes``: profile this machine and the nodes, solve the placement, deploy it and
    chat; the workers are stopped again when ``fleet up`` ends."""
    access = fleet_access(settings)
    agents = _agent_addresses(args, access)
    if not agents:
        raise FleetError("no node of this fleet was found: start `fleet agent` (or the tray worker) on the other "
                         "PCs, or name them with --nodes HOST:PORT,...")
    profile = _survey(model, agents, access=access, devices=settings.device, weights=settings.weights,
                      context=PLAN_CONTEXT, streams=args.users, reuse=not args.resurvey)
    doc, _ = _place(profile, objective=args.objective, users=args.users, pins=args.pin or [],
                    replicas=not args.one_chain)
    copies = layout_stages(doc)
    if len(copies) == 1 and len(copies[0]) == 1:
        why = ("the nodes would not make it faster (--objective throughput --users N weighs several users; "
               "--pin NODE:FIRST-LAST places layers by hand)" if len(doc["nodes"]) > 1 else
               "the only node agent found runs on this PC")
        say(f"the plan keeps every layer of {model} on this PC: {why}")
        return 0 if args.no_chat else _chat(args, "--model", model, "--stages", "1", tls=settings.tls)
    deployment, chains = deploy_layout(model, copies, access=access, shard=ShardOptions.of(settings),
                                       progress=progress_printer(), planned=planned_by(doc), standbys=settings.standbys)
    for chain in chains:
        chain.close()
    try:
        return _serve(args, model, deployment, settings.tls)
    finally:  # the chat's failover may have moved workers: the saved record names those that run now
        for problem in deployment.current().stop(access):
            say(f"warning: {problem}")


def _demo_up(args, settings: Settings, model: str) -> int:
    """``fleet up --demo``: demo nodes on this PC (simulated devices, real processes), profiled, the
    model split over this machine and them, deployed and chatted on; everything stops with ``fleet up``."""
    access = fleet_access(settings)
    fleet, deployment, chain, doc = demo_up(model, args.demo, access=access,
                                            shard=ShardOptions.of(settings), progress=progress_printer(), log=say)
    chain.close()
    try:
        for node in fleet.nodes:
            d = node.device
            say(f"demo node {node.name} (pid {node.process.pid}) at {node.address}: SIMULATED {d.name} ({d.full_name}, "
                f"{d.memory_mb / 1024:.0f} GB, profiled at {d.speed:g}x), running on this PC's CPU")
        names = {info.get("address"): info.get("name") for info in doc["nodes"].values()}
        say("placed by hand, evenly: " + "; ".join(
            f"{part_name(i)} on {names.get(s.node, s.node)} {s.device} ({layer_span(s.start, s.end)})"
            for i, s in enumerate(deployment.placement)) + f". Profile in {demo_profile()}. Chatting through "
            "`fleet serve --deployment` or the app, stop a demo node (kill its pid) to watch its layers move to the "
            "spare one")
        return _serve(args, model, deployment, settings.tls)
    finally:
        for problem in deployment.current().stop(access):
            say(f"warning: {problem}")
        fleet.close()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _where(deployment: Deployment) -> str:
    """Where a deployment's copies run, in words."""
    places = [(f"tensor-parallel rank 0 here, the other ranks at {', '.join(c.remotes)}" if c.ranks > 1 else
               f"every part on other PCs, at {', '.join(c.remotes)}" if c.fed else
               f"{part_name(0)} here, the other parts at {', '.join(c.remotes)}") if c.remotes
              else "whole on this PC" for c in deployment.copies]
    return places[0] if len(places) == 1 else f"{len(places)} copies of the model: " + "; ".join(places)


def _serve(args, model: str, deployment, tls: bool) -> int:
    """Records ``deployment`` and chats through it (or, with --no-chat, keeps it up) until the user
    ends it, with Ctrl-C or SIGTERM: either way the caller's cleanup stops the workers.  ``tls``: the
    settings' TLS, which the deployment was made with."""
    say(f"{model} is up: {_where(deployment)}")
    record = deployment.save()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if not args.no_chat:
            return _chat(args, "--deployment", str(record), tls=tls)
        print(f"ready {record}", flush=True)
        ended = threading.Event()
        if args.lifeline:  # the parent going away ends us like Ctrl-C: the workers are stopped
            from engine.launch import lifeline

            # an event, not interrupt_main: a parent that started us in the background leaves SIGINT
            # ignored, and then interrupt_main does nothing
            lifeline(on_close=ended.set)
        while not ended.wait(1.0):
            pass
        return 0
    except KeyboardInterrupt:
        return 0


def _chat(args, *source: str, tls: bool) -> int:
    """``generate`` on ``source``, reaching the fleet as this command does: TLS as given (this
    command's settings), not as the saved settings say."""
    connection = (["--fleet-key-file", args.fleet_key_file] if args.fleet_key_file else []) + (
        ["--tls" if tls else "--no-tls"]) + (["--deadline", str(args.deadline)] if args.deadline else [])
    return chat(*source, *connection)


def sim_delays(text: str) -> dict[str, float] | float:
    """``fleet sim --delay-ms``: one number for every PC, or NAME=MS,... for some of them."""
    text = text.strip()
    if "=" not in text:
        return duration(text)
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"takes MS or NAME=MS,... (pc1=20,pc2=5), not {text!r}")
        out[name.strip()] = duration(value.strip())
    return out


def _sim_delays(given, names: list[str]) -> dict[str, float]:
    if given is None:
        return {}
    if isinstance(given, float):
        return dict.fromkeys(names, given)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise FleetError(f"--delay-ms names {', '.join(unknown)}, not PCs of this office ({', '.join(names)})")
    return given


def cpu_quotas(text: str) -> list[float]:
    try:
        quotas = [float(q) for q in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"CPU quotas are ';'-separated cores, like 0.9;0.2, not {text!r}") from None
    if not all(0.01 <= q <= 64 for q in quotas):
        raise argparse.ArgumentTypeError(f"a CPU quota is between 0.01 and 64 cores, not {text!r}")
    return quotas


def cmd_sim(args) -> int:
    """``fleet sim``: an office of simulated PCs on this Linux machine (``engine.fleet.sim.office``), up until
    Ctrl-C; or, with --clean, only the removal of what a crashed one left."""
    require_root("fleet sim")
    if args.clean:
        removed = clean_leftovers(say)
        say("nothing left by an earlier simulated office" if not removed else f"removed {len(removed)} item(s)")
        return 0
    cpus = [c.strip() or None for c in args.cpus.split(";")] if args.cpus else [None]
    names = [f"pc{i + 1}" if i < args.pcs else f"far{i + 1 - args.pcs}" for i in range(args.pcs + args.routed)]
    delays = _sim_delays(args.delay_ms, names)
    quotas = args.cpu_quota or [None]
    specs = [NodeSpec(name, memory_mb=args.memory, cpus=cpus[i % len(cpus)], cpu_quota=quotas[i % len(quotas)],
                      rate_mbit=args.rate, remote=i >= args.pcs, delay_ms=delays.get(name))
             for i, name in enumerate(names)]
    access = access_of(args.fleet_key_file, tls=settings_of(args).tls, create=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Office(specs, access=access, root=paths().data / "sim", log=say) as office:
        print("\n".join(office.table()))
        say(f"this PC is {office.coordinator_ip} on the office's bridge: `fleet nodes` lists the PCs, "
            "`fleet up --nodes all` places a model on them (the routed PCs by address, with --nodes HOST:PORT)")
        print(f"ready {office.coordinator_ip}", flush=True)
        if args.lifeline:
            lifeline(on_close=stop.set)
        while not stop.wait(0.5):
            pass
    say("simulated office removed")
    return 0


def add_commands(sub) -> None:
    agent = sub.add_parser("agent", help="run this PC's node agent (advertised over mDNS, controlled by the fleet)")
    agent.add_argument("--listen", default="0.0.0.0:7390", help="HOST:PORT of the control API (default 0.0.0.0:7390)")
    agent.add_argument("--name", help="display name (default: the host name)")
    agent.add_argument("--store", help="where received shards are kept (default: the data folder)")
    agent.add_argument("--no-mdns", action="store_true", help="do not advertise the node over mDNS")
    agent.add_argument("--simulate", metavar="JSON", help='a demo node: report this simulated device instead of '
                       'the real ones, e.g. \'{"name": "GPU", "full_name": "laptop GPU", "memory_mb": 4096, '
                       '"speed": 2}\' (its work runs on this PC\'s CPU; `fleet up --demo` starts such nodes)')
    agent.add_argument("--link-delay-ms", type=duration, default=0.0,
                       help="hold every frame this PC's workers take and send by this one-way delay (ms): a "
                            "slow link, as `fleet sim --delay-ms` gives its PCs")
    agent.add_argument("--lifeline", action="store_true", help=argparse.SUPPRESS)
    connection_args(agent)
    agent.set_defaults(func=cmd_agent)

    nodes = sub.add_parser("nodes", help="list the fleet's nodes (mDNS, plus nodes added by address)")
    nodes.add_argument("--json", action="store_true")
    nodes.add_argument("--watch", action="store_true", help="keep listing nodes as they appear and leave")
    nodes.add_argument("--seconds", type=duration, default=3.0, help="how long to listen (default 3)")
    nsub = nodes.add_subparsers(dest="nodes_cmd")
    for verb in ("add", "remove"):
        p = nsub.add_parser(verb, help=f"{verb} a node by address (networks where multicast does not pass)"
                            + ("; also forgets it as a known node (join codes, scans)" if verb == "remove" else ""))
        p.add_argument("address", help="HOST:PORT of its agent")
    nsub.add_parser("join-code", help="print this fleet's join code: this PC's addresses, for the other PCs",
                    argument_default=argparse.SUPPRESS).add_argument(
        "--port", type=int, default=AGENT_PORT, help=f"this PC's agent port (default {AGENT_PORT})")
    p = nsub.add_parser("join", help="dial the PC a join code names, and keep its addresses as known nodes",
                        argument_default=argparse.SUPPRESS)
    p.add_argument("code", help="the join code (FS-...) copied on a PC of the fleet")
    p = nsub.add_parser("scan", help="dial the agent port on every address of this PC's subnet (a /24 at most); "
                                     "the nodes that prove the fleet key become known nodes",
                        argument_default=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=AGENT_PORT, help=f"the agents' port (default {AGENT_PORT})")
    p.add_argument("--seconds", type=duration, default=30.0, help="the whole scan's time limit (default 30)")
    p = nsub.add_parser("why", help="say why discovery finds no node (or only some): multicast, firewalls",
                        argument_default=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    # (options left out here keep the values given before "prune")
    prune = nsub.add_parser("prune", help="remove the shards a node's workers do not serve, for its disk space",
                            argument_default=argparse.SUPPRESS)
    prune.add_argument("address", help="HOST:PORT of its agent")
    connection_args(prune)
    connection_args(nodes)
    nodes.set_defaults(func=cmd_nodes)

    profile = sub.add_parser("profile", help="measure this PC (and nodes) for the placement solver")
    profile.add_argument("--model", help="the model to profile (default: the settings' model)")
    profile.add_argument("--nodes", help="'all' (discovered and added nodes) or HOST:PORT,... of agents")
    profile.add_argument("--device", help="this PC's devices to profile, comma-separated (default: settings)")
    profile.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_FORMATS)
    profile.add_argument("--context", type=count, default=PLAN_CONTEXT,
                         help="context length the KV cache is planned for")
    profile.add_argument("--streams", type=count, default=1, help="concurrent streams the KV cache is planned for")
    profile.add_argument("--seconds", type=duration, default=3.0, help="with --nodes all: how long to listen")
    profile.add_argument("--out", help="where to write the profile (default: the data folder)")
    connection_args(profile)
    profile.set_defaults(func=cmd_profile)

    place = sub.add_parser("place", help="choose the parts for the fleet with the placement solver")
    place.add_argument("--profile", help="a `fleet profile` document (default: the last one)")
    place.add_argument("--objective", default="latency", choices=["latency", "throughput"])
    place.add_argument("--users", type=count, default=1, help="concurrent users (throughput objective)")
    place.add_argument("--pin", action="append", type=_pin,
                       help="NODE:FIRST-LAST[:DEVICE]: these layers (both included) on this node, fixed by hand")
    place.add_argument("--out", help="where to write the plan (default: the data folder)")
    place.add_argument("--one-chain", action="store_true",
                       help="one chain over the nodes, never copies of the model for several users")
    place.set_defaults(func=cmd_place)

    dep = sub.add_parser("deploy", help="ship a plan's shards to its nodes and start the chain")
    dep.add_argument("--model")
    dep.add_argument("--plan", help="a plan written by `fleet place`")
    dep.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_FORMATS)
    dep.add_argument("--mode", choices=["fast", "exact"])
    dep.add_argument("--record", help="where to record the deployment (default: the data folder)")
    dep.add_argument("--stop", action="store_true", help="stop the recorded deployment's workers")
    dep.add_argument("--draft-on", metavar="AGENT", help="HOST:PORT of a node's agent that runs a draft server "
                     "for the deployment (drafting ahead while this PC verifies: `--draft remote:`)")
    dep.add_argument("--draft-model", help="with --draft-on: the draft model (default: the settings' draft model)")
    connection_args(dep)
    dep.set_defaults(func=cmd_deploy)

    up = sub.add_parser("up", help="bring up the default model on a local 2-part fleet (or, with --nodes, "
                                   "on the fleet's nodes) and chat")
    up.add_argument("--model")
    up.add_argument("--stages", type=count, help="parts of the local fleet (default: settings)")
    up.add_argument("--local", action="store_true", help="do not look for peers")
    up.add_argument("--nodes", help="'all' (discovered and added nodes) or HOST:PORT,... of agents: profile them, "
                                    "place the model with the solver, deploy and chat")
    up.add_argument("--objective", default="latency", choices=["latency", "throughput"], help="with --nodes")
    up.add_argument("--users", type=count, default=1, help="with --nodes: concurrent users planned for")
    up.add_argument("--one-chain", action="store_true", help="with --nodes: one chain, never copies of the model")
    up.add_argument("--pin", action="append", type=_pin,
                    help="with --nodes: NODE:FIRST-LAST[:DEVICE], as in `fleet place`")
    up.add_argument("--demo", nargs="?", type=count, const=MAX_NODES, metavar="N",
                    help=f"try the fleet on this PC alone: start N (1 to {MAX_NODES}, default {MAX_NODES}) demo nodes "
                         "with simulated devices, profile them, split the model over this PC and them (the "
                         "last kept spare for failover), deploy and chat")
    up.add_argument("--resurvey", action="store_true", help="with --nodes: profile the fleet even if it was "
                                                            "profiled in the last day")
    up.add_argument("--seconds", type=duration, default=2.0, help="how long to look for peers")
    up.add_argument("--no-chat", action="store_true", help="keep the fleet up without chatting (prints ready)")
    up.add_argument("--lifeline", action="store_true", help=argparse.SUPPRESS)
    connection_args(up)
    up.set_defaults(func=cmd_up)

    sim = sub.add_parser("sim", help="simulate an office of PCs on this Linux machine (network namespaces, "
                                     "one node agent each; needs root)")
    sim.add_argument("--pcs", type=count, default=3, help="PCs on the office's subnet (default 3)")
    sim.add_argument("--routed", type=int, default=0, help="PCs on another subnet, behind a router: reached by "
                                                           "address, not by mDNS (default 0)")
    sim.add_argument("--memory", type=count, default=2048, help="each PC's memory cap in MB (default 2048)")
    sim.add_argument("--cpus", help="each PC's CPU set, ';'-separated, repeated over the PCs: \"0;1\" "
                                    "(default: every CPU)")
    sim.add_argument("--cpu-quota", type=cpu_quotas, metavar="CORES;...",
                     help="each PC's share of CPU time in cores, ';'-separated, repeated over the PCs: \"0.9;0.9;0.2\" "
                          "(default: no quota)")
    sim.add_argument("--rate", type=float, help="each PC's link speed in Mbit/s (default: not capped)")
    sim.add_argument("--delay-ms", type=sim_delays, metavar="MS|NAME=MS,...",
                     help="one-way link delay: one value for every PC (20) or per PC (pc1=20,far1=5); their "
                          "workers hold each frame they take and send by it (default: none)")
    sim.add_argument("--clean", action="store_true", help="only remove what a crashed simulated office left")
    sim.add_argument("--lifeline", action="store_true", help=argparse.SUPPRESS)
    connection_args(sim)
    sim.set_defaults(func=cmd_sim)
