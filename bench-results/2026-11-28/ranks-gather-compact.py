"""What the ranks' vocabulary gather costs a token, whole against top-1: Qwen2.5-Coder-1.5B `gguf` as two
tensor-parallel ranks in the simulated office (this process PC 1 on core 0 with rank 0, PC 2 on core 1
at 1 Gbit/s with rank 1 in a `fleet worker`), greedy decoding through the RankChain.  Each round
decodes 32 tokens after a 40-token prompt, with the forwards' flags either NONE (rank 1 sends each
row's top-1 of its vocabulary slice: 8 bytes) or LOGITS (its whole slice, 304 kB; the chain also
copies the full logits into its output, ~0.1 ms), the two alternating ABBA.  Prints ms a decode
token (median of each round), the time rank 0 spends in the gather (mean a decode token: from its
arrival there to the slices in place, so it includes any wait for rank 1) and the tokens (which
must agree).

Run as root: python ranks-gather-compact.py ROUNDS
"""
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.bench.sim.shared import pin_process
from engine.export.exporter import export_model, rank_folder
from engine.fleet.sim.office import NodeSpec, Office
from engine.fleetkey import create_key, load_key
from engine.launch import fleet_command
from engine.runtime.relay.ranks import RankChain
from engine.transport.mesh import Mesh
from engine.transport.wire import Flag

MODEL, PROMPT, N, PORT = "qwen2.5-coder-1.5b", list(range(100, 140)), 32, 7330


GATHER_MS: list[float] = []
_gather = Mesh._gather


def timed_gather(self, x, out):
    t = time.perf_counter()
    _gather(self, x, out)
    GATHER_MS.append((time.perf_counter() - t) * 1000)


Mesh._gather = timed_gather


def decode(chain, flags):
    ids, times = list(PROMPT), []
    chain.reset(0)
    out = chain.forward(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None], flags)
    GATHER_MS.clear()
    for _ in range(N):
        ids.append(int(out.tokens[-1]))
        t = time.perf_counter()
        out = chain.forward(np.array([[ids[-1]]]), np.ones((1, len(ids)), np.int64), np.array([[len(ids) - 1]]), flags)
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times)), float(np.mean(GATHER_MS)), ids[len(PROMPT):]


def main(rounds: int) -> None:
    ranks = export_model(MODEL, weights="gguf", ranks=2).out
    with tempfile.TemporaryDirectory() as tmp:
        key_file = create_key(Path(tmp) / "fleet.key")
        with Office([NodeSpec("pc2", cpus="1", rate_mbit=1000.0)], key_file=key_file, root=Path(tmp) / "o") as office:
            pc2 = office.nodes["pc2"]
            office.spawn("pc2", fleet_command("worker", "--shard", str(rank_folder(ranks, 1)), "--listen",
                                              f"0.0.0.0:{PORT}", "--device", "CPU", "--no-tls", "--fleet-key-file",
                                              str(key_file)), Path(tmp) / "rank1.log")
            before = pin_process({0})
            chain = RankChain(rank_folder(ranks, 0), [f"{pc2.ip}:{PORT}"], key=load_key(key_file), connect_timeout_s=300)
            try:
                decode(chain, Flag.NONE)  # warm
                got, gathers, tokens = {"top-1": [], "whole": []}, {"top-1": [], "whole": []}, {}
                for r in range(rounds):
                    order = [("top-1", Flag.NONE), ("whole", Flag.LOGITS)]
                    for name, flags in (order if r % 2 == 0 else order[::-1]):
                        ms, gather_ms, tokens[name] = decode(chain, flags)
                        got[name].append(round(ms, 1))
                        gathers[name].append(round(gather_ms, 2))
                        print(f"round {r + 1} {name}: {ms:.1f} ms a token, gather {gather_ms:.2f} ms", flush=True)
                for name, values in got.items():
                    print(f"{name}: median {np.median(values):.1f} ms a token {values}; gather median "
                          f"{np.median(gathers[name]):.2f} ms {gathers[name]}")
                print("tokens agree:", tokens["top-1"] == tokens["whole"], tokens["top-1"][:8])
            finally:
                chain.close()
                pin_process(before)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
