"""`fleet serve`'s API over the tiny Qwen2 model, in process, for the API tests: the service and an
official openai client pointed at it."""

from __future__ import annotations

import contextlib

import openai

from engine.config import Scheduling
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.serve.server import ApiServer

MODEL = "tiny"


@contextlib.contextmanager
def served_tiny(tiny_exports, streams: int):
    """(service, client) over the tiny 2-stage Qwen2 export in `exact` mode, stopped on exit."""
    service = ChatService(LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact")),
                          scheduling=Scheduling(streams=streams))
    server = ApiServer(service, port=0, model_id=MODEL).start()
    try:
        yield service, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    finally:
        server.stop()
        service.close()


def reply_text(response, stream: bool) -> tuple[str, str]:
    """(text, finish reason) of an OpenAI client's chat completion, streamed or not."""
    if stream:
        chunks = list(response)
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    return response.choices[0].message.content, response.choices[0].finish_reason
