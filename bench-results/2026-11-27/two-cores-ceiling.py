"""How much two of this VM's vCPUs add up: Qwen 1.5B whole, U users, in one process pinned to one core
(alone), against two such processes each on its own core at once.  python ceiling.py [child CORE USERS TOKENS OUT]"""
import json, os, subprocess, sys, time
from statistics import median

def child(core, users, tokens, out):
    os.sched_setaffinity(0, {core})
    from engine.bench.harness import STORY_PROMPT
    from engine.export.exporter import export_model
    from engine.runtime.stages.chain import LocalChain
    from engine.runtime.decode.generate import generate_streams
    from engine.runtime.decode.tokenizer import ChatTokenizer
    folders = export_model("qwen2.5-coder-1.5b", stages=1, weights="int4").folders
    chain = LocalChain(folders)
    tok = ChatTokenizer(folders[0])
    prompts = [tok.prompt_ids(f"({i}) " + STORY_PROMPT) for i in range(users)]
    length = prompts[0].shape[1] + tokens + 8
    generate_streams(chain, prompts, 8, max_length=length, ignore_eos=True)  # warm
    open(out + ".ready", "w").close()
    while not os.path.exists(out + ".go"):
        time.sleep(0.01)
    res, wall = generate_streams(chain, prompts, tokens, max_length=length, ignore_eos=True)
    open(out, "w").write(json.dumps(sum(len(g.tokens) for g in res) / wall))

def run(cores, users, tokens, tag):
    outs = [f"/tmp/s47/ceil-{tag}-{c}" for c in cores]
    for o in outs:
        for suffix in ("", ".ready", ".go"):
            if os.path.exists(o + suffix): os.remove(o + suffix)
    procs = [subprocess.Popen([sys.executable, __file__, "child", str(c), str(users), str(tokens), o]) for c, o in zip(cores, outs)]
    while not all(os.path.exists(o + ".ready") for o in outs):
        time.sleep(0.05)
    for o in outs: open(o + ".go", "w").close()
    for p in procs: p.wait()
    return sum(json.loads(open(o).read()) for o in outs)

if sys.argv[1:2] == ["child"]:
    child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
else:
    tokens = 64
    result = {}
    for users in (1, 2, 4):
        alone, both = [], []
        for r in range(3):
            alone.append(run([0], users, tokens, "a")); both.append(run([0, 1], users, tokens, "b"))
        result[users] = {"one core alone": round(median(alone), 2), "two cores at once": round(median(both), 2),
                         "ratio to 2x alone": round(median(both) / (2 * median(alone)), 3), "alone": alone, "both": both}
        print(users, result[users], flush=True)
    print(json.dumps(result))
