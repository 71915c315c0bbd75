# python faithful-f16-kl.py TOKENS SHARD_FOLDER...  (the KL rows of faithful-f16-kl-qwen1.5b.json)
"""KL of several 1-stage shard folders against the f32 reference, at f32 and the default."""
import sys, tempfile, json, numpy as np
from pathlib import Path
from engine.bench.quality import bench_text, log_probs, compare
from engine.export.exporter import export_model
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.runtime.decode.tokenizer import ChatTokenizer
def main():
    ref = export_model("qwen2.5-coder-1.5b", stages=1, weights="f32")
    tok = ChatTokenizer(ref.folders[0])
    ids = tok.prompt_ids(bench_text(None), chat=False)[0, :int(sys.argv[1])]
    chain = LocalChain(ref.folders, device="CPU", config=compile_config("exact"))
    reference = None
    for start, part in log_probs(chain, ids):
        if reference is None:
            reference = np.lib.format.open_memmap("/tmp/ref.npy", mode="w+", dtype=np.float32, shape=(len(ids), part.shape[-1]))
        reference[start:start + len(part)] = part
    chain.close()
    for d in sys.argv[2:]:
        for prec, cfg in (("f32", compile_config("exact")), ("fast", {})):
            chain = LocalChain([Path(d)], device="CPU", config=cfg)
            print(d, prec, compare(reference, chain, ids), flush=True)
            chain.close()

if __name__ == '__main__':
    main()
