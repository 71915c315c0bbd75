"""Verify cost by width on one core: the 1.5B target and the 0.5B draft, interleaved."""
import os, sys, time, statistics
from pathlib import Path
from engine.runtime.stages.chain import LocalChain
from engine.runtime.decode.kvsequence import KVSequence
from engine.transport.wire import Flag

if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    folders = [Path(sys.argv[1])]
    chain = LocalChain(folders)
    seq = KVSequence(chain, 1024, 0, "mask")
    seq.reset()
    seq.forward(list(range(100, 140)))
    widths = [int(w) for w in sys.argv[2].split(",")]
    times = {w: [] for w in widths}
    for rep in range(int(sys.argv[3])):
        for w in widths:
            for _ in range(3):  # same width thrice: the steady-width cost, last of them counted
                t = time.perf_counter()
                seq.forward(list(range(200, 200 + w)), Flag.ALL_POSITIONS if w > 1 else Flag.NONE)
                dt = time.perf_counter() - t
                seq.reject(w)
            times[w].append(dt * 1e3)
    for w in widths:
        print(f"width {w}: median {statistics.median(times[w]):.1f} ms  {[round(x) for x in times[w]]}")
