"""Peak and steady memory of one 1-stage shard in a fresh process: python rss.py DIR"""
import sys, time, numpy as np
from pathlib import Path
from engine.runtime.stages.stage import StageRunner

def status():
    f = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {k: int(f[k].split()[0]) // 1024 for k in ("VmHWM", "VmRSS")}

def main():
    t = time.perf_counter()
    st = StageRunner(Path(sys.argv[1]), "CPU")
    load = time.perf_counter() - t
    ids = [9707, 11, 1246, 525, 498, 30, 358, 1079, 4460, 311]
    n = len(ids)
    st.forward(np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None], last_only=True)
    tok = 300
    for i in range(8):
        o = st.forward(np.array([[tok]], np.int64), np.ones((1, n + i + 1), np.int64), np.array([[n + i]]), last_only=True)
        tok = int(np.argmax(o[0, -1]))
    print(sys.argv[1], "load+compile s", round(load, 1), status(), "last token", tok, flush=True)

if __name__ == "__main__":
    main()
