"""Grammar-constrained decoding: which tokens a reply may take next, so that it follows a JSON schema
(``response_format``) or a tool-call syntax.

The constraint is llguidance's (``LLMatcher``): a grammar (Lark-like text, or a JSON schema compiled
to one) over the tokenizer's byte strings gives, at each step, the set of tokens that keep the reply
a prefix of some sentence of the grammar.  It was chosen for its cost, a mask a token cheap beside a
decode step (docs/guide.md, "Structured output", compares it with outlines-core and with xgrammar,
which needs torch).

The tokens' bytes come from the shard's own detokenizer (``openvino_detokenizer.xml``: the
``VocabDecoder``'s begins, ends and characters), so a worker's folder is all a coordinator needs:
no Hugging Face tokenizer at run time.

A ``Constraint`` follows one reply: ``mask_rows`` masks the full logits of the positions a round
verified, checking speculative drafts against the grammar on the way (a draft the grammar refuses
ends the run that can be accepted), and ``accept`` advances it by the tokens emitted.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import llguidance
import numpy as np

from engine.errors import FleetError, ShardError

SPACE_MARK = "\u2581".encode()  # SentencePiece's word start, a space once decoded
_BYTE_TOKEN = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")
_DTYPES = {"i32": np.int32, "u8": np.uint8, "i64": np.int64}


class GrammarError(FleetError):
    """A schema or grammar the constraint cannot follow (the API answers 400, naming ``field``)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def token_bytes(folder: Path) -> tuple[list[bytes], list[int]]:
    """Each token id's bytes, and the special tokens' ids, from the shard's detokenizer."""
    folder = Path(folder)
    xml, blob_path = folder / "openvino_detokenizer.xml", folder / "openvino_detokenizer.bin"
    if not xml.exists() or not blob_path.exists():
        raise ShardError(f"{folder} holds no detokenizer: constrained decoding needs the first stage's shard")
    root = ET.parse(xml).getroot()
    blob = blob_path.read_bytes()
    consts, kinds = [], set()
    for layer in root.iter("layer"):
        kinds.add(layer.get("type"))
        if layer.get("type") == "Const":
            data = layer.find("data").attrib
            dtype = np.dtype(_DTYPES.get(data["element_type"], np.uint8))
            consts.append(np.frombuffer(blob, dtype, int(data["size"]) // dtype.itemsize, int(data["offset"])))
    # VocabDecoder's inputs, in the order the converter writes them: begins, ends, characters, skipped ids
    if "VocabDecoder" not in kinds or len(consts) < 4 or consts[0].shape != consts[1].shape \
            or consts[2].dtype != np.uint8:
        raise ShardError(f"{folder}: the detokenizer's vocabulary is not laid out as expected (VocabDecoder's "
                         "begins, ends and characters): this tokenizer cannot be constrained")
    begins, ends, chars = consts[0], consts[1], consts[2].tobytes()
    special = [int(i) for i in consts[3]] if consts[3].dtype != np.uint8 else []
    sentencepiece = "ByteFallback" in kinds
    tokens = []
    for b, e in zip(begins.tolist(), ends.tolist()):
        raw = chars[b:e]
        if sentencepiece:
            byte = _BYTE_TOKEN.match(raw)
            raw = bytes([int(byte.group(1), 16)]) if byte else raw.replace(SPACE_MARK, b" ")
        tokens.append(raw)
    return tokens, special


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: the tokens' bytes, EOS, specials, and an encoder."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, encode):
        self.tokens, self.special_token_ids, self.eos_token_id, self.bos_token_id = tokens, special, eos, None
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class GrammarTokenizer:
    """llguidance's view of a model's tokenizer, made once per tokenizer (it indexes the vocabulary)."""

    def __init__(self, folder: Path, eos: frozenset[int], encode):
        tokens, special = token_bytes(folder)
        eos_ids = sorted(i for i in eos if i < len(tokens)) or [special[0] if special else 0]
        special = sorted(set(special) | set(eos_ids))
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokens, special, eos_ids[0], encode))
        self.size = len(tokens)
        self.eos = eos_ids
        self.ll = llguidance.LLTokenizer(wrapper, eos_token=eos_ids)


# A schema is compiled at a cost that grows with its size (10,000 properties: seconds), and walked
# recursively (by ``closed`` and the compiler): both are bounded before any work is done on it.
MAX_SCHEMA_CHARS = 512 * 1024  # a schema's JSON text (about 17,000 simple properties)
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema's JSON (a property object is two)
# An object's optional properties may come in any subset: llguidance's parser holds about four items
# a property in one row, at most 2000, and fails at the reply's first token past ~500 (measured).
MAX_OPTIONAL_PROPERTIES = 400


def check_schema(spec, field: str) -> int:
    """The JSON text length of a schema within the bounds above, or a ``GrammarError`` naming ``field``."""
    def walk(value, level: int) -> int:  # stops one past the depth limit: never recurses deeper than that
        if level > MAX_SCHEMA_DEPTH or not isinstance(value, (dict, list)):
            return level
        if isinstance(value, dict) and isinstance(value.get("properties"), dict):
            required = value.get("required") if isinstance(value.get("required"), list) else []
            optional = len(value["properties"].keys() - {r for r in required if isinstance(r, str)})
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise GrammarError(f"{field}: an object of the schema has {optional} optional properties; at most "
                                   f"{MAX_OPTIONAL_PROPERTIES} (list the others in its required)", field)
        return max((walk(v, level + 1) for v in (value.values() if isinstance(value, dict) else value)),
                   default=level)

    if walk(spec, 0) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{field}: the schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays",
                           field)
    size = len(json.dumps(spec))
    if size > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{field}: the schema is {size} characters of JSON; at most {MAX_SCHEMA_CHARS}", field)
    return size


def compile_grammar(kind: str, spec=None, field: str = "response_format") -> str:
    """llguidance grammar text for a ``kind``: ``json_schema`` (``spec`` the schema), ``json_object``
    (any JSON object) or ``lark`` (``spec`` a Lark-like grammar); a schema the compiler refuses, or
    one past ``check_schema``'s bounds, is a ``GrammarError`` naming ``field``.  A large schema
    takes seconds: the API compiles off its event loop."""
    if kind == "json_object":
        spec, kind = {"type": "object"}, "json_schema"
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise GrammarError(f"{field}: the JSON schema must be an object, not {type(spec).__name__}", field)
        check_schema(spec, field)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(closed(spec)), defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"{field}: not a usable JSON schema ({exc})", field) from None
    elif kind == "lark":
        grammar = llguidance.LLMatcher.grammar_from_lark(spec)
    else:
        raise ValueError(f"unknown grammar kind {kind!r}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"{field}: the schema cannot be followed ({error.strip()})", field)
    return grammar


def closed(schema):
    """``schema`` with every object that lists its properties and says nothing of others closed
    (``additionalProperties: false``, as OpenAI's strict mode has it): a reply never needs a property
    its schema does not name, and a small model that may add them wanders on until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("enum", "const", "default", "examples") else v for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


# JSON as a compact reply writes it: no whitespace between items (a random or small model would
# otherwise pad a reply with whitespace until max_tokens), "additionalProperties" as the schema says
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Constraint:
    """One reply's grammar state over a ``GrammarTokenizer``."""

    def __init__(self, grammar: str, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be followed: {self.matcher.get_error()}")
        self._bits = np.arange(32, dtype=np.uint32)
        self._allowed: np.ndarray | None = None  # the current state's mask, once computed

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes no further token but an EOS."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """Which token ids may come next, as a bool [vocabulary] array.  ``Decoding`` asks for it
        once a round is submitted, so that over a remote chain it is computed while the round runs."""
        if self._allowed is None:
            words = np.frombuffer(self.matcher.compute_bitmask(), np.uint32)
            self._allowed = ((words[:, None] >> self._bits) & 1).astype(bool).reshape(-1)[: self.tokenizer.size]
        return self._allowed

    def mask_rows(self, rows: np.ndarray, drafts: list[int]) -> tuple[np.ndarray, list[int]]:
        """The logits of a round's verified positions (``[len(drafts) + 1, vocab]``, the rows after
        ``drafts[:i]``) with every token the grammar refuses at -inf, and the drafts the grammar
        allows up to the first it refuses (the rest cannot be accepted), or up to an end of text (a
        matcher rolled back over its end of text loses a token more).  The matcher is left where it
        was."""
        masked, legal = [], []
        for i in range(len(drafts) + 1):
            row = np.full(rows.shape[-1], -np.inf, np.float32)
            allowed = self.allowed()
            row[: allowed.size][allowed] = rows[i, : allowed.size][allowed]
            masked.append(row)
            if i == len(drafts) or drafts[i] >= allowed.size or not allowed[drafts[i]] \
                    or drafts[i] in self.tokenizer.eos:
                break
            if i == 0:
                first = allowed
            self.matcher.consume_token(drafts[i])
            self._allowed = None
            legal.append(drafts[i])
        if legal:
            self.matcher.rollback(len(legal))
            self._allowed = first
        return np.stack(masked), legal

    def accept(self, token: int) -> None:
        """Advances by an emitted token (one ``mask_rows`` allowed)."""
        self._allowed = None
        if not self.matcher.consume_token(int(token)):
            raise FleetError(f"constrained decoding: token {token} broke the grammar ({self.matcher.get_error()})")
