"""One user: the target on core 0 alone, and with drafts from a draft server on core 1 (the new
policy, and padded rounds forced: the policy before), interleaved wave by wave."""
import os, sys, subprocess, time, statistics, tempfile
from pathlib import Path
from engine.bench.sim.shared import chat_wave
from engine.bench.harness import PROMPTS
from engine.export.exporter import export_model
from engine.fleetkey import create_key, load_key
from engine.launch import fleet_command
from engine.runtime.decode.remotedraft import DraftLink
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import draft_head
from engine.runtime.stages.chain import LocalChain

if __name__ == "__main__":
    runs, tokens = int(sys.argv[1]), int(sys.argv[2])
    target = export_model("qwen2.5-coder-1.5b", stages=1, weights="auto").folders
    draft = export_model("qwen2.5-coder-0.5b", stages=1, weights="auto", head=draft_head("auto")).folders
    tmp = Path(tempfile.mkdtemp())
    key_file = create_key(tmp / "fleet.key"); key = load_key(key_file)
    server = subprocess.Popen(["taskset", "-c", "1", *fleet_command("worker", "--role", "draft", "--shard", str(draft[0]),
                               "--listen", "127.0.0.1:7399", "--device", "CPU", "--no-tls", "--fleet-key-file", str(key_file))],
                              stderr=open(tmp / "server.log", "w"))
    os.sched_setaffinity(0, {0})
    try:
        chain = LocalChain(target)
        for _ in range(600):
            try:
                link = DraftLink("127.0.0.1:7399", key, chain.manifest); break
            except Exception:
                time.sleep(0.5)
        def fixed(n):
            ds = [link.drafter(i) for i in range(n)]
            for d in ds: d._goes_plain = lambda guesses: False
            return ds
        made = []
        services = {
            "plain": ChatService(LocalChain(target), streams=1, prefix_cache=False),
            "remote": ChatService(LocalChain(target), streams=1, drafters=lambda n: made.extend(link.drafter(i) for i in range(n)) or made[-n:], k="auto", prefix_cache=False),
            "remote, always padded": ChatService(LocalChain(target), streams=1, drafters=fixed, k="auto", prefix_cache=False),
        }
        for svc in services.values():
            chat_wave(svc, 1, 16)
        got = {n: [] for n in services}
        for r in range(runs):
            for name, svc in services.items():
                prompt = list(PROMPTS.values())[r % len(PROMPTS)]
                t0 = time.perf_counter()
                rep = svc.submit([{"role": "user", "content": prompt}], tokens, ignore_eos=True).wait(1200)
                tok_s, ttft = len(rep.tokens) / (time.perf_counter() - t0), rep.ttft_ms
                got[name].append(tok_s)
                print(f"run {r+1} {name}: {tok_s:.3f} tok/s (ttft {ttft:.0f} ms) drafted {rep.drafted} accepted {rep.accepted}", flush=True)
        import json
        json.dump(got, open("/tmp/exp/remote.json", "w"))
        for name, v in got.items():
            print(f"{name}: median {statistics.median(v):.3f} ({statistics.median(v)/statistics.median(got['plain']):.3f}x plain)")
        for name in ("remote",):
            ds = services[name].drafters if hasattr(services[name], "drafters") else None
        print("state", [(d.plain_s, d.padded_s, d.gain, d._plain) for d in made])
    finally:
        server.terminate(); server.wait()
        print(open(tmp / "server.log").read()[-600:])
