"""lm-evaluation-harness against ``fleet serve``: its ``local-completions`` model type runs a tiny
multiple-choice task (loglikelihood requests: ``echo`` with the prompt's ``logprobs``) and a
generate_until task, both defined from local files (tests/data/lm_eval), and its parsed results
equal what the API itself answers for each document."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openai

from engine.config import Scheduling
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.serve.server import ApiServer

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"


def test_lm_eval_harness_through_the_completions_api(tiny_models, tiny_exports, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task files name their data relative to the repository
    service = ChatService(LocalChain(tiny_exports["qwen2", "1"].folders), scheduling=Scheduling(streams=2))
    server = ApiServer(service, port=0, model_id="tiny").start()
    try:
        results = simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{server.url}/completions", "model": "tiny", "tokenizer_backend": "huggingface",
                        "tokenizer": str(tiny_models["qwen2"]), "tokenized_requests": False,
                        "num_concurrent": 1, "max_retries": 1},
            tasks=["fleet_tiny_choice", "fleet_tiny_generate"], task_manager=TaskManager(include_path=str(TASKS)),
            log_samples=True)
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        docs = [json.loads(line) for line in (TASKS / "fleet_tiny.jsonl").read_text().splitlines()]

        def loglikelihood(context: str, continuation: str) -> float:
            got = client.completions.create(model="tiny", prompt=context + continuation, max_tokens=0, echo=True,
                                            logprobs=1, temperature=0)
            ctx = service.tokenizer.chat_ids([{"role": "user", "content": context}], chat=False).size
            return sum(got.choices[0].logprobs.token_logprobs[ctx:])

        ours = [[loglikelihood(d["question"], c) for c in d["choices"]] for d in docs]
        samples = sorted(results["samples"]["fleet_tiny_choice"], key=lambda s: s["doc_id"])
        theirs = [[resp[0][0] for resp in s["resps"]] for s in samples]
        assert len(theirs) == len(docs) and all(np.allclose(a, b, atol=1e-3) for a, b in zip(ours, theirs))
        acc = np.mean([int(np.argmax(lls)) == d["answer"] for lls, d in zip(ours, docs)])
        assert results["results"]["fleet_tiny_choice"]["acc,none"] == acc

        texts = [client.completions.create(model="tiny", prompt=d["question"], max_tokens=8, stop=["\n"],
                                           temperature=0).choices[0].text for d in docs]
        samples = sorted(results["samples"]["fleet_tiny_generate"], key=lambda s: s["doc_id"])
        assert [s["resps"][0][0] for s in samples] == texts
        match = np.mean([t == d["target"] for t, d in zip(texts, docs)])
        assert results["results"]["fleet_tiny_generate"]["exact_match,none"] == match
    finally:
        server.stop()
        service.close()
