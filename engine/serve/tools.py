"""Tool calling for the chat API: the tools a request offers rendered into the prompt, the grammar
that holds a forced call to its function's JSON schema, and the model's calls parsed back out of its
text (whole, or as a stream of deltas).

The call syntax is Hermes' (Qwen2.5's and many others'): ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, one block per call.  A model whose chat template renders tools in that
syntax (its template names ``tools`` and ``<tool_call>``) gets the tools and its history through its
own template; any other (SmolLM2's template knows no tools) gets the generic rendering below: the
tool list in the system prompt, earlier calls as those blocks in the assistant's text, and tool
results as ``<tool_response>`` blocks in a user turn.

``tool_choice``: ``required`` or a named function constrain the reply to calls from its first token
(``parallel_tool_calls`` false: exactly one); ``auto`` lets the model write text, but once it opens
``<tool_call>`` the call is held to the grammar too (llguidance's lazy lexeme ends the free text at
that tag); ``none`` renders no tools and parses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from engine.runtime.decode.grammar import (JSON_OPTIONS, MAX_SCHEMA_CHARS, GrammarError, check_schema, closed,
                                            compile_grammar)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass
class ToolPlan:
    """The tools a reply may call, how it must call them, and the grammar that holds it to that."""

    tools: list[dict]  # OpenAI's {"type": "function", "function": {name, description, parameters}}
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    grammar: str | None = None  # auto: free text, or text and then calls held to their schemas

    @property
    def forced(self) -> bool:
        """The reply must be calls from its first token (``required`` or a named function)."""
        return self.choice != "auto"

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def plan_tools(tools: list[dict], choice: str | None, parallel: bool = True) -> ToolPlan | None:
    """The plan of a request's ``tools`` and ``tool_choice`` (``auto``, ``none``, ``required`` or a
    function's name), or None when no tool may be called; a choice that cannot be honoured is a
    ``GrammarError`` naming the field."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise GrammarError(f"tool_choice: {choice!r} needs tools, and the request has none", "tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise GrammarError("tools: two tools have the same name", "tools")
    if choice == "none":
        return None
    choice = choice or "auto"
    if choice not in CHOICES and choice not in names:
        raise GrammarError(f"tool_choice: no tool is named {choice!r} (the tools are {', '.join(names)})",
                           "tool_choice")
    for i, tool in enumerate(tools):  # a call's arguments are an object (the APIs parse them as one)
        kind = (tool["function"].get("parameters") or {}).get("type", "object")
        if kind != "object":
            raise GrammarError(f"tools[{i}].function.parameters: a tool's arguments are a JSON object, so its schema's "
                               f"type is \"object\", not {json.dumps(kind)}", f"tools[{i}].function.parameters")
    sizes = [check_schema(t["function"]["parameters"], f"tools[{i}].function.parameters")
             for i, t in enumerate(tools) if t["function"].get("parameters") is not None]
    if sum(sizes) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"tools: the tools' parameter schemas are {sum(sizes)} characters of JSON together; "
                           f"at most {MAX_SCHEMA_CHARS}", "tools")
    plan = ToolPlan(tools, choice, parallel)
    called = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    calls = _calls_rule(called, parallel)
    if choice == "auto":
        # free text that ends where the model opens a call (the tag is the lazy lexeme's suffix), or
        # free text to the end; a call it opens is held to the schemas
        plan.grammar = compile_grammar("lark", "%llguidance {}\n"
                                       "start: TEXT | lead first more\n"
                                       "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
                                       f"lead[suffix={_lark_str(CALL_OPEN)}]: ANY\n"
                                       "ANY: /(?s:.*)/\n"
                                       f"{calls}", "tools")
    else:
        plan.grammar = compile_grammar("lark", "%llguidance {}\nstart: " + _lark_str(CALL_OPEN) + " first more\n"
                                       + calls, "tools")
    return plan


def _calls_rule(tools: list[dict], parallel: bool) -> str:
    """Lark rules ``first`` (a call after its opening tag) and ``more`` (further calls, or none)."""
    lines, alternatives = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = closed(fn.get("parameters") or {"type": "object", "properties": {}})  # none: no arguments
        schema.setdefault("type", "object")
        schema["x-guidance"] = JSON_OPTIONS
        head = json.dumps({"name": fn["name"], "arguments": 0})[:-2]  # '{"name": "f", "arguments": '
        lines.append(f"fn{i}: {_lark_str(head)} %json {json.dumps(schema)} {_lark_str('}')}")
        alternatives.append(f"fn{i}")
    newline, close, reopen = _lark_str("\n"), _lark_str("\n" + CALL_CLOSE), _lark_str("\n" + CALL_OPEN)
    lines.append(f"first: {newline} ({' | '.join(alternatives)}) {close}")
    if parallel:
        lines.append(f"more: ({reopen} first)*")
    else:
        lines.append('more: ""')
    return "\n".join(lines) + "\n"


def _lark_str(text: str) -> str:
    return json.dumps(text)


def tools_fit_template(template: str) -> bool:
    """Whether a chat template renders tools itself, in the Hermes call syntax we parse."""
    return "tools" in template and CALL_OPEN in template


def render(messages: list[dict], plan: ToolPlan | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """The conversation as the chat template is given it, and the tools for the template (None: the
    tools, if any, are in the messages): with ``native`` the template's own rendering (earlier
    calls' arguments as objects, as templates expect), else the generic one (module docstring)."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                      "arguments": _loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, plan.tools if plan else None
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": _loads(c["function"]["arguments"])})
                      + f"\n{CALL_CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + blocks)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if plan is not None:
        prompt = tool_prompt(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def tool_prompt(tools: list[dict]) -> str:
    """The generic tool list of a system prompt (Hermes' wording, which Qwen2.5's template uses)."""
    listed = "\n".join(json.dumps(t) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            f'{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n{{"name": <function-name>, "arguments": '
            f"<args-json-object>}}\n{CALL_CLOSE}")


def _loads(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def to_call(body: str, names: list[str]) -> dict | None:
    """An OpenAI tool call from the text between the tags, or None if it is not a call to one of ``names``."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("name") not in names:
        return None
    arguments = doc.get("arguments", doc.get("parameters", {}))
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": doc["name"], "arguments": arguments}}


def parse(text: str, names: list[str]) -> tuple[str | None, list[dict]]:
    """A whole reply's text (None when there is none beside the calls) and its tool calls."""
    stream = CallStream(names)
    content, calls = stream.push(text)
    more, rest = stream.flush()
    content, calls = content + more, calls + rest
    if calls:
        content = content.strip()
    return content or None, calls


class CallStream:
    """Splits a reply's text as it streams into text and tool calls: text that may begin a call's
    tag is held back until known not to, a call is given out whole once its closing tag arrives,
    and whitespace between calls is dropped."""

    def __init__(self, names: list[str]):
        self.names = names
        self.buffer = ""
        self.called = 0

    def push(self, piece: str) -> tuple[str, list[dict]]:
        self.buffer += piece
        text, calls = "", []
        while True:
            start = self.buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_tag(self.buffer)
                text += self._text(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return text, calls
            end = self.buffer.find(CALL_CLOSE, start)
            if end < 0:
                text += self._text(self.buffer[:start])
                self.buffer = self.buffer[start:]
                return text, calls
            text += self._text(self.buffer[:start])
            body = self.buffer[start + len(CALL_OPEN): end]
            self.buffer = self.buffer[end + len(CALL_CLOSE):]
            call = to_call(body, self.names)
            if call is None:
                text += CALL_OPEN + body + CALL_CLOSE
            else:
                calls.append(call)
                self.called += 1

    def flush(self) -> tuple[str, list[dict]]:
        """The end of the reply: a call cut short (by max_tokens) is given as text."""
        rest, self.buffer = self.buffer, ""
        return self._text(rest), []

    def _text(self, text: str) -> str:
        return text if not self.called or text.strip() else ""


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def prepare(messages: list[dict], plan: ToolPlan | None, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """``render`` for a ``ChatTokenizer``: natively where its template renders Hermes tool calls."""
    return render(messages, plan, tools_fit_template(tokenizer.template))


def parse_reply(text: str, names: list[str] | None, finish_reason: str) -> tuple[dict, str]:
    """A whole chat reply's message and finish reason: with tools, its calls parsed out
    (``finish_reason`` ``tool_calls`` when it made any)."""
    if not names:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse(text, names)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
