"""Speculative decoding and micro-batching: mask-based rewind against the physical trim, exact-mode
output equal to plain greedy decoding for several K and draft sources, compaction instead of
overflow, refusal of a foreign draft tokenizer, and isolated streams in process and over loopback."""

from __future__ import annotations

import threading

import numpy as np
import openvino as ov
import pytest

from engine.config import FleetAccess, Scheduling, Settings, ShardOptions
from engine.errors import ShardError
from engine.fleetkey import access_of, create_key, load_key
from engine.manifest import load_manifest
from engine.runtime.decode.generate import Decoding, Generator, generate_streams
from engine.runtime.decode.kvsequence import KVSequence
from engine.runtime.decode.speculative import (AheadGate, AutoK, Drafter, DraftModel, Hybrid, PromptLookup, RoundCost,
                                               check_draft_tokenizer)
from engine.runtime.relay.local_workers import LocalWorkers
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.output import Output
from engine.runtime.stages.stage import MODES, compile_config, has_bf16
from engine.runtime.stages.turns import compute_turns
from engine.session import Launch, open_service
from engine.transport.wire import Flag

EXACT = MODES["exact"]
PROMPT = [5, 17, 42, 101, 7, 250, 33, 64, 9, 17, 42, 101]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_masked_rewind_equals_physical_trim_exactly(arch, tiny_exports):
    # Bit-equal in bf16 compute with a bf16 cache.  In f32 compute (a CPU without bf16 runs the bf16
    # hint in f32) the two differ by a few ulps: the attention sums over a different number of (masked)
    # slots, so its reduction is blocked differently.
    # Gemma's sliding window (4 tokens) must count the masked slots out, as trimming does.
    chain = LocalChain(tiny_exports[arch, "2"].folders, paged=False,  # the stateful stages' rewinds
                       config={"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"})
    logits = {}
    for rewind in ("mask", "trim"):
        seq = KVSequence(chain, 128, rewind=rewind)
        seq.reset()
        seq.forward(PROMPT)
        seq.forward([3, 4, 5])
        seq.reject(2)  # two wrong guesses
        seq.forward([8, 9, 10])
        seq.reject(1)
        seq.forward([12, 13, 14, 15])  # the tokens after the holes reach a window's length
        logits[rewind] = seq.forward([11], Flag.LOGITS).logits
        assert seq.logical == len(PROMPT) + 1 + 2 + 4 + 1
        assert seq.physical == (seq.logical + 3 if rewind == "mask" else seq.logical)
    if has_bf16():
        assert np.array_equal(logits["mask"], logits["trim"])
    else:
        np.testing.assert_allclose(logits["mask"], logits["trim"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3, 5, "auto"])
@pytest.mark.parametrize("rewind", ["mask", "trim"])
def test_exact_speculation_equals_greedy_on_tiny(k, rewind, tiny_exports):
    # the mask rewind on stateful stages; trimming on the default (paged) ones
    paged = False if rewind == "mask" else None
    target = LocalChain(tiny_exports["qwen2", "3"].folders, config=EXACT, paged=paged)
    want = Generator(target, 128).generate(PROMPT, 40, ignore_eos=True).tokens
    # A draft that is the target itself accepts everything; prompt lookup accepts some; the hybrid both.
    self_draft = DraftModel(LocalChain(tiny_exports["qwen2", "1"].folders, config=EXACT, paged=paged), rewind)
    for drafter in (self_draft, PromptLookup(), Hybrid(PromptLookup(), self_draft)):
        gen = Generator(target, 128, rewind=rewind).generate(PROMPT, 40, ignore_eos=True, drafter=drafter, k=k)
        assert gen.tokens == want, drafter.name
        assert gen.drafted > 0
        if drafter is self_draft:
            assert gen.acceptance > 0.9
        if rewind == "trim":
            assert gen.bloat == 1.0


def test_exact_mode_keeps_its_settings_to_the_target(tiny_exports):
    # Only the target's verify decides tokens: in exact mode the draft still compiles with the fast
    # settings (a 16-bit KV cache here, not exact's f32).
    settings = Settings(mode="exact", streams=1, draft="hybrid", draft_model=str(tiny_exports["qwen2", "1"].folders[0]))
    service = open_service(settings, Launch(shards=tiny_exports["qwen2", "3"].folders, workers="none"))
    try:
        target, (hybrid,) = service.chain, service.drafters
        assert target.stages[0].compiled.get_property("KV_CACHE_PRECISION") == ov.Type.f32
        assert hybrid.model.chain.stages[0].compiled.get_property("KV_CACHE_PRECISION") == ov.Type.f16
        want = Generator(target, 128).generate(PROMPT, 40, ignore_eos=True).tokens
        gen = Generator(target, 128, rewind=service.rewind).generate(PROMPT, 40, ignore_eos=True, drafter=hybrid,
                                                                     k="auto")
    finally:
        service.close()
    assert gen.tokens == want
    assert gen.bloat == 1.0 and hybrid.model.seq.rewind == "trim"  # paged stages cut rejected guesses


def test_the_draft_model_takes_in_the_prompt_with_the_prefill(tiny_exports):
    # the draft's prefill is prompt processing: it happens at start, not in the first decode round
    target = LocalChain(tiny_exports["qwen2", "3"].folders, config=EXACT)
    draft = DraftModel(LocalChain(tiny_exports["qwen2", "1"].folders, config=EXACT))
    decoding = Decoding(KVSequence(target, 128), PROMPT, 8, frozenset(), drafter=draft, k=3)
    decoding.start()
    assert draft.fed == PROMPT and draft.seq.logical == len(PROMPT)


def test_auto_k_charges_a_catch_up_once_per_round():
    # A draft model whose catch-up costs 30 ms on top of 19 ms per draft step, a verify of 52 ms plus
    # 4 per position: the round cost is fitted as fixed + per draft * K (not as a cost per drafted
    # token, which would price K=1 at 49 ms a draft), and with every draft accepted K grows.  The
    # first round after a change of K pays 15 ms more (the plugin re-prepares for the new shape):
    # the fit leaves such rounds out.
    auto = AutoK(k_start=1)
    last = None
    for k in (1, 1, 2, 2, 1, 1, 2, 2):
        switch = 15 if k != last else 0
        auto.update(k, k, verify_ms=52 + 4 * (k + 1) + switch, draft_ms=30 + 19 * k)
        last = k
    fixed, per_draft = auto.costs.fit()
    assert fixed == pytest.approx(52 + 4 + 30, abs=0.5) and per_draft == pytest.approx(19 + 4, abs=0.5)
    assert auto.k > 2


def test_auto_k_keeps_its_k_against_a_marginal_gain():
    # acceptance 0.8 and rounds costing 100 + 22 ms per draft: K=4 is the best, 0.6% ahead of K=3
    # and 5.5% ahead of K=2; a change of K costs a re-preparation of the verify, so only K=2 moves
    for current, chosen in ((3, 3), (2, 4)):
        auto = AutoK(k_start=current)
        auto.successes, auto.failures = 4.0, 1.0
        auto.cost = lambda k: 100.0 + 22.0 * k
        assert auto.choose() == chosen


class WrongGuesses(Drafter):
    name = "wrong"

    def propose(self, history, k):
        return [(history[-1] + 1 + i) % 384 for i in range(k)]


class CostlyModel(WrongGuesses):
    """A draft model's shape as the hybrid sees it (its cost comes with each round's feedback)."""

    name = "model"

    def __init__(self):
        self.pick_k = False
        self.costs = RoundCost()

    def feedback(self, proposed, accepted, verify_ms, draft_ms):
        self.costs.add(proposed, verify_ms, draft_ms)

    def learn(self, accepted):
        pass


class Scripted:
    """A draft chain that says, after each position, the token after it (``+1``) or always token 7
    (``same``), with probability ``prob``; it counts its forwards."""

    def __init__(self, prob: float, next_token: str = "+1"):
        self.prob = prob
        self.next_token = next_token
        self.forwards = 0
        self.fed, self.positions = [], []  # each forward's ids and position ids
        self.spec = type("Spec", (), {"max_position": 256})

    def reset(self, stream=0):
        pass

    def keep(self, stream, slots):
        pass

    def submit(self, ids, attention_mask, position_ids, flags=Flag.NONE, stream=0):
        self.forwards += 1
        self.fed.append(ids[0].tolist())
        self.positions.append(position_ids[0].tolist())
        tokens = ids[0] + 1 if self.next_token == "+1" else np.full(ids.shape[1], 7)
        if not flags & Flag.ALL_POSITIONS:
            tokens = tokens[-1:]
        return Output(tokens, np.full(len(tokens), self.prob, np.float32) if flags & Flag.PROBS else None)

    def collect(self, ticket):
        return ticket


@pytest.mark.parametrize("prob, fixed_ms, drafts", [(0.99, 80, 12), (0.5, 80, 1), (0.5, 300, 3)])
def test_the_draft_model_drafts_as_far_as_its_confidence_pays(prob, fixed_ms, drafts):
    # rounds cost fixed + 22 ms per draft: a sure draft goes up to K; an unsure one stops after one
    # token when the round is cheap, but drafts more when the round's fixed part (a slow hop) is large
    model = DraftModel(Scripted(prob))
    model.pick_k = True
    model.costs.add(1, fixed_ms - 20, 42)
    model.costs.add(3, fixed_ms - 20, 86)
    for _ in range(40):  # the draft's mean confidence settles
        got = model.propose([1, 2, 3], AutoK.K_MAX)
    assert len(got) == drafts
    model.pick_k = False
    assert len(model.propose([1, 2, 3], 4)) == 4  # a fixed K drafts K


def test_an_under_confident_draft_drafts_further_once_verification_shows_it():
    # top-1 probability 0.55, rounds at 80 ms + 22 ms per draft: taken at its word the second draft
    # does not pay; once every draft it makes is accepted, its confidence is scaled up and it does
    model = DraftModel(Scripted(0.55))
    model.pick_k = True
    model.costs.add(1, 60, 42)
    model.costs.add(3, 60, 86)
    for _ in range(40):  # the draft's mean confidence settles; no verify outcome yet
        got = model.propose([1, 2, 3], AutoK.K_MAX)
    assert len(got) == 1
    for _ in range(40):
        got = model.propose([1, 2, 3], AutoK.K_MAX)
        model.learn(len(got))
    assert len(got) == 2


def test_a_right_guess_beside_a_draft_step_gives_the_next_draft_free():
    # each single-token step goes in beside a guess (prompt lookup's, else the token again); a draft
    # that always says 7 confirms a guess of 7, and that forward's second position is the next draft
    chain = Scripted(0.9, next_token="same")
    model = DraftModel(chain)
    assert model.propose([1, 2, 3], 4) == [7, 7, 7, 7]
    assert chain.forwards == 3  # the catch-up, then two steps of two positions for three drafts
    # the cache holds the prompt and the drafts fed (the last draft's right guess was masked out)
    assert model.fed == [1, 2, 3, 7, 7, 7] and model.seq.logical == 6 and model.seq.physical == 7
    chain = Scripted(0.9)  # a wrong guess is masked out and costs nothing more
    model = DraftModel(chain)
    assert model.propose([1, 2, 3], 4) == [4, 5, 6, 7] and chain.forwards == 4
    assert model.seq.logical == 6 and model.seq.physical == 9


def test_rejected_drafts_are_masked_between_the_masked_guesses():
    # every draft step leaves a masked wrong guess behind its token, so a round's rejected drafts
    # are not the cache's last slots: the next catch-up masks exactly their slots
    model = DraftModel(Scripted(0.9))
    assert model.propose([1, 2, 3], 4) == [4, 5, 6, 7]
    # slots: 1 2 3 | 4 guess | 5 guess | 6 guess (each guess masked)
    assert model.seq.mask[0, :9].tolist() == [1, 1, 1, 1, 0, 1, 0, 1, 0]
    model.propose([1, 2, 3, 4, 99], 1)  # the target kept the first draft only: 5 and 6 go
    assert model.seq.mask[0, :11].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0]
    assert model.seq.mask.sum() == len(model.fed) == 5


def test_a_long_catch_up_feeds_only_the_recent_tokens():
    # after many rounds without the model (the hybrid's lookup rounds) its catch-up feeds
    # the last MAX_CATCH_UP tokens; positions still follow the whole sequence, and the next
    # catch-up sees the left-out tokens as already there
    chain = Scripted(0.9)
    model = DraftModel(chain)
    prompt = list(range(10, 30))
    model.prime(prompt)
    history = prompt + list(range(100, 140))  # 40 new tokens
    chain.fed, chain.positions = [], []
    model.propose(history, 1)
    assert chain.fed[0] == history[-DraftModel.MAX_CATCH_UP:]  # one forward of the last 16
    assert chain.positions[0][0] == len(history) - DraftModel.MAX_CATCH_UP
    assert model.seq.logical == len(history) and model.seq.physical == len(prompt) + DraftModel.MAX_CATCH_UP
    chain.fed, chain.positions = [], []
    model.propose(history + [7, 8], 1)
    assert chain.fed[0][:2] == [7, 8]  # only what is new since
    assert model.fed == history + [7, 8] and model.seq.physical == len(prompt) + DraftModel.MAX_CATCH_UP + 2


def model_round_passing_over(hybrid: Hybrid, accepted: int, draft_ms: float, history: list[int], source: str,
                             drafts: list[int], given: list[int]) -> None:
    """A steady model round of 3 drafts (60 ms verify) that passed over the lookup's ``drafts`` for
    ``history``; the round gave ``given``, which scores them."""
    hybrid._previous = hybrid.last = "model"
    hybrid.feedback(3, accepted, verify_ms=60.0, draft_ms=draft_ms)
    hybrid._unused = (len(history), source, drafts)
    hybrid._score_unused(history + given)


def test_the_hybrid_judges_lookup_matches_by_their_length():
    # one-token matches keep failing while the model is right 80% of the time: after that, a
    # one-token match goes to the model, but a three-token match is still tried once a round has
    # scored it (never on its prior alone)
    hybrid = Hybrid(PromptLookup(), CostlyModel())
    one_gram = [1, 2, 3, 9, 4, 5, 6, 9]  # ends with 9: seen once before, followed by 4
    three_gram = [1, 2, 3, 4, 5, 1, 2, 3]  # ends with 1 2 3: seen before, followed by 4 5
    for _ in range(30):
        hybrid._skipped = 0  # no exploration rounds in this test
        drafts = hybrid.propose(one_gram, 3)
        model = hybrid.last == "model"
        hybrid.feedback(len(drafts), 2 if model else 0, verify_ms=60.0, draft_ms=60.0 if model else 0.1)
        hybrid.last = "model"
        hybrid.feedback(3, 3, verify_ms=60.0, draft_ms=60.0)
    hybrid.propose(one_gram, 3)
    assert hybrid.last == "model"
    hybrid.propose(three_gram, 3)
    assert hybrid.last == "model"  # no outcome yet: its proposal is scored against the model's round
    hybrid.feedback(3, 0, verify_ms=60.0, draft_ms=60.0)
    hybrid.propose(three_gram + [4], 3)  # its first draft was right; ends with 2 3 4, followed by 5
    assert hybrid.last == "lookup3"


def test_a_brief_hard_patch_for_the_model_does_not_hand_its_rounds_to_the_lookup():
    # the model gives 3 tokens per 100 ms round while a one-token lookup, scored against its rounds,
    # has its first draft right every other time; then the model's drafts fail for a few rounds.
    # The lookup fails on that text too, so three bad rounds leave the model drafting; twenty
    # hand the rounds to the lookup
    def last_choice(hard_rounds: int) -> str:
        hybrid = Hybrid(PromptLookup(), CostlyModel())
        one_gram = [1, 2, 3, 9, 4, 5, 6, 9]  # ends with 9: seen once before, followed by 4 5 6
        for i in range(40 + hard_rounds):
            hard = i >= 40
            given = [4, 0, 0] if i % 2 == 0 and not hard else [0, 0, 0]
            model_round_passing_over(hybrid, 0 if hard else 2, 40.0, one_gram, "lookup1", [4, 5, 6], given)
        hybrid._skipped = 0  # no exploration round
        hybrid.propose(one_gram, 3)
        return hybrid.last

    assert last_choice(3) == "model"
    assert last_choice(20) == "lookup1"


def hybrid_choices(history: list[int], rounds: int, verify_ms) -> list:
    """A hybrid's choice each round when every draft is rejected; ``verify_ms(drafts)``: the round's time."""
    hybrid = Hybrid(PromptLookup(), CostlyModel())
    chosen = []
    for _ in range(rounds):
        drafts = hybrid.propose(history, 3)
        chosen.append(hybrid.last)
        hybrid.feedback(len(drafts), 0, verify_ms(drafts), draft_ms=60.0 if hybrid.last == "model" else 0.0)
        hybrid._score_unused(history + [-1])  # a lookup proposal the round passed over was wrong too
    return chosen


def test_where_nothing_matches_the_hybrid_drafts_with_the_model():
    # a model that is always wrong, nothing to look up, and plain steps at half a round's time:
    # still the model every round (under K auto it drafts only as far as its confidence pays, and
    # a plain step between drafted rounds would change the verify's width twice)
    chosen = hybrid_choices([1, 2, 3, 4, 5, 6, 7, 8], 30, lambda drafts: 60.0 if drafts else 30.0)
    assert chosen == ["model"] * 30


def test_where_the_lookup_matches_the_hybrid_takes_the_lookup_or_the_model():
    # one-token matches that are always wrong, and a model that is too, at twice their cost: the
    # lookup; under K auto it proposes K=3
    chosen = hybrid_choices([1, 2, 3, 9, 4, 5, 6, 9], 40, lambda drafts: 70.0 if drafts else 35.0)
    assert None not in chosen and chosen[-16:].count("lookup1") >= 14
    hybrid = Hybrid(PromptLookup(), CostlyModel())
    hybrid.pick_k = True
    hybrid.last = "lookup2"
    hybrid.feedback(3, 3, verify_ms=60.0, draft_ms=0.0)
    assert hybrid.propose([1, 2, 3, 4, 5, 6, 1, 2], AutoK.K_MAX) == [3, 4, 5]


def test_the_hybrid_charges_leaving_the_model_for_its_return():
    # the model's rounds cost 100 ms after its own and 160 ms after a lookup round (a longer
    # catch-up); a lookup that beats a model round on its own is not worth the dearer return
    hybrid = Hybrid(PromptLookup(), CostlyModel())
    for previous, ms in (("model", 100.0), (None, 160.0)) * 2:
        hybrid._previous, hybrid.last = previous, "model"
        hybrid.feedback(3, 2, verify_ms=ms - 60.0, draft_ms=60.0)
    # the model's own fit, which sets how far it drafts, holds only its steady rounds
    assert hybrid.model.costs.cost(3) == pytest.approx(100.0)
    assert hybrid.return_costs.cost(3) == pytest.approx(160.0)
    for accepted in (1, 2, 1, 2):
        hybrid.last = "lookup1"
        hybrid.feedback(3, accepted, verify_ms=70.0, draft_ms=0.0)
    one_gram = [1, 2, 3, 9, 4, 5, 6, 9]
    for current, choice in (("model", "model"), (None, "lookup1")):
        hybrid.last = current
        hybrid._skipped = 0  # no exploration rounds
        hybrid.propose(one_gram, 3)
        assert hybrid.last == choice


def test_the_hybrid_scores_the_lookup_while_the_model_drafts():
    # three-token lookups failed, so the model drafts; then the text repeats itself and what the
    # lookup would have proposed is what the model's rounds give: the hybrid goes back to the
    # lookup on that record alone (no exploration round)
    hybrid = Hybrid(PromptLookup(), CostlyModel())
    for source, accepted, draft_ms in (("lookup3", 0, 0.0), ("model", 2, 60.0)) * 4:
        hybrid.last = source
        hybrid.feedback(3, accepted, verify_ms=70.0, draft_ms=draft_ms)
    period = [1, 2, 3, 4, 5, 6, 7, 8]
    history = period * 2
    chosen = []
    for _ in range(6):
        hybrid._skipped = 0
        drafts = hybrid.propose(history, 3)
        chosen.append(hybrid.last)
        if hybrid.last == "model":
            hybrid.feedback(len(drafts), 2, verify_ms=70.0, draft_ms=60.0)
        n = len(history)
        history = history + [period[(n + i) % 8] for i in range(3)]  # the round's accepted drafts + 1
    assert chosen[0] == "model"
    assert "lookup3" in chosen


def test_the_hybrid_scores_a_passed_over_lookup_only_where_the_text_reached():
    # lookup rounds: the first draft right, the second wrong; between them model rounds of one
    # token each, which the lookup's first draft would have matched.  Those rounds say nothing of
    # the second and third drafts: the lookup is still worth two tokens a round (60 ms), below
    # the model's four (100 ms), however often its first draft is confirmed
    hybrid = Hybrid(PromptLookup(), CostlyModel())
    history = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # ends with 1 2 3: seen before, followed by 4 5 6
    for _ in range(10):
        hybrid.last = "lookup3"
        hybrid.feedback(3, 1, verify_ms=60.0, draft_ms=0.0)
        for _ in range(3):
            model_round_passing_over(hybrid, 3, 40.0, history, "lookup3", [4, 5, 6], [4])
    hybrid._skipped = 0
    hybrid.propose(history, 3)
    assert hybrid.last == "model"


def test_a_sequence_that_would_outgrow_the_context_compacts(tiny_exports):
    # only a stateful cache has holes
    target = LocalChain(tiny_exports["llama", "2"].folders, config=EXACT, paged=False)
    want = Generator(target, 72).generate(PROMPT, 60, ignore_eos=True).tokens
    # Drafts that are (almost) always wrong: the masked holes push the physical length past 72 long
    # before the logical one gets there.
    generator = Generator(target, 72, rewind="mask")
    gen = generator.generate(PROMPT, 60, ignore_eos=True, drafter=WrongGuesses(), k=6)
    assert gen.tokens == want
    assert gen.compactions >= 1
    assert gen.to_json()["speculative"]["kv_bloat"] >= 1.0
    again = generator.generate(PROMPT, 60, ignore_eos=True, drafter=WrongGuesses(), k=6)
    assert again.compactions == gen.compactions  # each generation reports its own, not a running total


def test_draft_with_another_tokenizer_is_refused(tiny_exports):
    qwen = tiny_exports["qwen2", "1"].folders[0]
    llama = tiny_exports["llama", "1"].folders[0]
    with pytest.raises(ShardError, match="does not share the target .*tokenizer"):
        check_draft_tokenizer(load_manifest(qwen), load_manifest(llama), llama)
    check_draft_tokenizer(load_manifest(qwen), load_manifest(tiny_exports["qwen2", "2"].folders[0]), qwen)


def test_a_precision_hint_from_the_command_line_is_the_targets_alone(tiny_exports):
    from argparse import Namespace

    from engine.cli.args import settings_of
    from engine.session import draft_shards, drafter_factory

    folder = tiny_exports["qwen2", "1"].folders[0]
    target = LocalChain([folder], config=compile_config("fast", "bf16"))
    settings = settings_of(Namespace(draft=f"hybrid:{folder}", device=None, precision="bf16"), Settings())
    [hybrid] = drafter_factory(settings.draft, target, draft_shards(settings), settings.device)(1)
    hint = "INFERENCE_PRECISION_HINT"
    drafting = hybrid.model.chain.stages[0]
    # the draft keeps the device's default (the f32 hint on CPU: its fastest drafting)
    assert (target.stages[0].config[hint], drafting.config[hint]) == ("bf16", "f32")
    if has_bf16():  # else the CPU computes the target's bf16 in f32 too
        assert target.stages[0].compiled.get_property(hint) == ov.Type.bf16
    assert drafting.compiled.get_property(hint) == ov.Type.f32


def _streams(chain, prompts, tokens=24, **kw):
    results, _ = generate_streams(chain, prompts, tokens, max_length=128, ignore_eos=True, **kw)
    return [r.tokens for r in results]


def _isolation(chain):
    a, b, c = PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4]
    single = {name: Generator(chain, 128).generate(p, 24, ignore_eos=True).tokens
              for name, p in (("a", a), ("b", b), ("c", c))}
    assert _streams(chain, [a, a]) == [single["a"], single["a"]]
    assert _streams(chain, [a, b, c]) == [single["a"], single["b"], single["c"]]
    assert _streams(chain, [c, b, a]) == [single["c"], single["b"], single["a"]]
    # speculation inside micro-batching (each stream its own lookup drafter)
    assert _streams(chain, [a, c], drafters=[PromptLookup(), PromptLookup()], scheduling=Scheduling(k=3)) == \
        [single["a"], single["c"]]
    # a stream cancelled early leaves its neighbours alone
    stop = threading.Event()
    results, _ = generate_streams(chain, [a, b], 24, max_length=128, ignore_eos=True, cancels=[None, stop],
                                  on_token=lambda i, t: stop.set() if i == 1 else None)
    assert results[1].stopped_by == "cancelled" and len(results[1].tokens) < 24
    assert results[0].tokens == single["a"]


@pytest.mark.parametrize("isolate", [False, True], ids=["shared", "per-stream-compiled"])
def test_micro_batched_streams_are_isolated_in_process(isolate, tiny_exports):
    chain = LocalChain(tiny_exports["qwen2", "3"].folders, config=EXACT, isolate=isolate)
    _isolation(chain)
    assert all(stage.compiles == (len(stage.streams) if isolate else 1) for stage in chain.stages)


@pytest.mark.parametrize("isolate", [False, True], ids=["shared", "per-stream-compiled"])
def test_micro_batched_streams_are_isolated_over_loopback(isolate, tiny_exports, tmp_path):
    folders = tiny_exports["qwen2", "3"].folders
    key = create_key(tmp_path / "fleet.key")
    exact = ShardOptions(mode="exact")
    with LocalWorkers(folders[1:], access_of(key), log_dir=tmp_path, shard=exact, isolate=isolate) as fleet:
        assert fleet.turns is not None  # the stages and the coordinator take compute turns
        chain = RemoteChain(folders[0], fleet.addresses, access=FleetAccess(load_key(key)), shard=exact,
                            isolate=isolate, turns=compute_turns(fleet.turns))
        try:
            _isolation(chain)
            # speculation with physical trim over the wire (KEEP frames) is still exact
            want = Generator(chain, 128).generate(PROMPT, 30, ignore_eos=True).tokens
            gen = Generator(chain, 128, rewind="trim").generate(PROMPT, 30, ignore_eos=True,
                                                                drafter=PromptLookup(), k=4)
            assert gen.tokens == want and gen.drafted > 0
        finally:
            chain.close()


def test_spec_bench_repeats_each_prompt_and_averages_the_paired_ratios(tiny_models, tmp_path):
    import json

    from engine.bench.spec import AGAIN, run_spec

    folder = str(tiny_models["qwen2"])  # its own draft: same tokenizer
    report = run_spec(folder, folder, tokens=6, runs=2, weights="f32", out=tmp_path / "spec.json",
                      log=lambda m: None)
    assert json.loads((tmp_path / "spec.json").read_text()) == report
    assert report["settings"]["runs"] == 2 and len(report["rows"]) == 16  # two modes, eight prompts
    for row in report["rows"]:
        for label in ("model K=3", "model K=auto", "lookup K=3", "hybrid K=auto", AGAIN):
            runs = row[f"{label} runs"]
            assert len(runs) == 2 and row[f"{label} x"] == pytest.approx(sum(runs) / 2, abs=1e-3)
            if row["mode"] == "exact":
                assert row[f"{label} same"], (row["prompt"], label)
        paired = row["hybrid vs model K=auto"], row["hybrid vs lookup K=3"]
        assert min(paired) > 0 and row["hybrid vs better of two"] == min(paired)
        assert row["A/A"] > 0
        assert row["genai_spec_tok_s"] > 0 if row["mode"] == "fast" else "genai_spec_tok_s" not in row
    assert report["ratios"]["exact model K=auto identical"] == "8/8"
    aa = [row["A/A"] for row in report["rows"] if row["mode"] == "fast"]
    assert (report["ratios"]["fast A/A: model K=auto vs itself (min)"],
            report["ratios"]["fast A/A: model K=auto vs itself (max)"]) == (min(aa), max(aa))


class _Oracle(Drafter):
    """Drafts the target's own greedy continuation (``want`` after ``prompt``), but spoils every
    ``spoil``-th proposal's last token: rounds sent ahead are kept, and now and then discarded."""

    def __init__(self, prompt: list[int], want: list[int], spoil: int = 3):
        self.text, self.spoil, self.calls = list(prompt) + list(want), spoil, 0

    def propose(self, history, k):
        self.calls += 1
        if self.text[:len(history)] != list(history):  # after a spoiled draft: a guess, wrong
            return [int(history[-1]) % 200 + 3] * k
        follow = self.text[len(history):len(history) + k]
        if follow and self.calls % self.spoil == 0:
            follow[-1] = (follow[-1] + 1) % 200 + 3
        return follow


@pytest.mark.parametrize("isolate", [False, True], ids=["paged-trim", "stateful-mask"])
def test_speculating_ahead_over_a_pipeline_equals_greedy(isolate, tiny_exports, tmp_path, hosting, monkeypatch):
    # One stream, two rounds in flight: stage 0 computes the round sent ahead while stage 1 verifies
    # the one before it; a wrong assumption is rewound on both stages (KEEP frames, or masks).
    monkeypatch.setattr(AheadGate, "opens", lambda self, *args: True)  # every round goes ahead
    folders = tiny_exports["qwen2", "2"].folders
    key = create_key(tmp_path / "fleet.key")
    exact = ShardOptions(mode="exact")
    with LocalWorkers(folders[1:], access_of(key), log_dir=tmp_path, shard=exact, isolate=isolate,
                      hosting=hosting) as fleet:
        chain = RemoteChain(folders[0], fleet.addresses, access=FleetAccess(load_key(key)), shard=exact,
                            isolate=isolate, turns=compute_turns(fleet.turns))
        try:
            assert chain.packs != isolate
            rewind = "mask" if isolate else "trim"
            want = Generator(chain, 128).generate(PROMPT, 40, ignore_eos=True).tokens
            model = DraftModel(LocalChain(tiny_exports["qwen2", "1"].folders, config=EXACT))  # the target itself
            for drafter in (_Oracle(PROMPT, want), PromptLookup(), _Oracle(PROMPT, want, spoil=1), model):
                plain = Generator(chain, 128, rewind=rewind, scheduling=Scheduling(k=3))
                plain_gen = plain.generate(PROMPT, 40, ignore_eos=True, drafter=drafter)
                chain.most_in_flight = 0
                ahead = Generator(chain, 128, rewind=rewind, scheduling=Scheduling(k=3, speculate_ahead=True))
                gen = ahead.generate(PROMPT, 40, ignore_eos=True, drafter=drafter)
                assert plain_gen.tokens == gen.tokens == want, drafter.name
                assert gen.ahead > 0 and plain_gen.ahead == 0
                assert chain.most_in_flight >= 2  # the round sent ahead travelled beside the one verified
                assert ahead.seq.logical == plain.seq.logical  # what was sent ahead and not kept is gone
                if isinstance(drafter, _Oracle) and drafter.spoil > 1:
                    assert 0 < gen.ahead_kept < gen.ahead
                elif drafter is model:  # it drafts what the target decodes: its guesses hold
                    assert gen.ahead_kept > gen.ahead // 2
                else:  # every proposal spoiled, or lookup's guesses: few kept, the output still greedy's
                    assert gen.ahead_kept < gen.ahead
            assert not chain._in_flight and not chain._groups  # every discarded round was collected
        finally:
            chain.close()


def test_speculating_ahead_stops_at_the_end_of_text_like_plain_speculation(tiny_exports, monkeypatch):
    # An end of text inside a kept round: the round sent ahead after it is rewound, as a reject is.
    monkeypatch.setattr(AheadGate, "opens", lambda self, *args: True)
    chain = LocalChain(tiny_exports["qwen2", "2"].folders, config=EXACT)
    want = Generator(chain, 128).generate(PROMPT, 40, ignore_eos=True).tokens
    eos = [want[17]]
    ends = {}
    for ahead in (False, True):
        gen = Generator(chain, 128, eos_ids=eos, rewind="trim", scheduling=Scheduling(k=4, speculate_ahead=ahead))
        result = gen.generate(PROMPT, 40, drafter=_Oracle(PROMPT, want, spoil=4))
        assert result.stopped_by == "eos" and result.tokens == want[:want.index(eos[0]) + 1]
        ends[ahead] = gen.seq.logical, result.ahead
    assert ends[True][0] == ends[False][0] and ends[True][1] > 0 and ends[False][1] == 0


def test_speculating_ahead_is_off_by_default_and_only_on_the_greedy_path():
    from argparse import Namespace

    from engine.cli.args import settings_of
    from engine.runtime.decode.sampling import SamplingParams

    assert Settings().speculate_ahead is False
    assert settings_of(Namespace(speculate_ahead=True), Settings()).speculate_ahead is True
    assert settings_of(Namespace(speculate_ahead=None), Settings(speculate_ahead=True)).speculate_ahead is True
    assert Scheduling().speculate_ahead is False and Scheduling.of(Settings(speculate_ahead=True)).speculate_ahead
    seq = KVSequence(LocalChain.__new__(LocalChain), 64)
    ahead = Scheduling(speculate_ahead=True)
    assert not Decoding(seq, PROMPT, 8, frozenset(), drafter=PromptLookup()).speculate_ahead
    assert Decoding(seq, PROMPT, 8, frozenset(), scheduling=ahead, drafter=PromptLookup()).speculate_ahead
    assert not Decoding(seq, PROMPT, 8, frozenset(), scheduling=ahead, drafter=None).speculate_ahead
    sampled = SamplingParams(temperature=0.8)
    assert not Decoding(seq, PROMPT, 8, frozenset(), scheduling=ahead, drafter=PromptLookup(),
                        sampling=sampled).speculate_ahead


def test_a_decoding_drafts_as_its_scheduling_says_unless_its_request_names_k():
    seq = KVSequence(LocalChain.__new__(LocalChain), 64)
    five = Scheduling(k=5)
    assert Decoding(seq, PROMPT, 8, frozenset(), scheduling=five, drafter=PromptLookup()).k == 5
    assert Decoding(seq, PROMPT, 8, frozenset(), scheduling=five, drafter=PromptLookup(), k=2).k == 2
    auto = Decoding(seq, PROMPT, 8, frozenset(), drafter=PromptLookup())  # Scheduling's K: auto
    assert auto.auto is not None and auto.k == AutoK().k
    assert Decoding(seq, PROMPT, 8, frozenset(), scheduling=Scheduling(prefill_chunk=7)).prefill_chunk == 7


def test_the_ahead_bench_compares_a_round_at_a_time_with_speculating_ahead(tiny_models, tmp_path):
    import json

    from engine.bench.ahead import run_ahead
    from engine.bench.registry import BENCHES

    folder = str(tiny_models["qwen2"])  # its own draft: same tokenizer
    report = run_ahead(folder, folder, draft_kind="model", tokens=12, runs=2, mode="exact", weights="f32",
                       out=tmp_path / "ahead.json", log=lambda m: None)
    assert json.loads((tmp_path / "ahead.json").read_text()) == report
    rows = {row["config"]: row for row in report["rows"]}
    assert list(rows) == ["whole model", "whole model + speculation", "2 parts", "2 parts + speculation",
                          "2 parts + speculation ahead"]
    for row in rows.values():  # exact: every speculative output is greedy's, sixteen of sixteen
        assert row["same_as_greedy"] == row["of"] == 16 and row["tok_s"] > 0, row
    ahead = rows["2 parts + speculation ahead"]
    assert 0 < ahead["ahead_kept"] <= ahead["ahead"] and "ahead" not in rows["2 parts + speculation"]
    assert ahead["acceptance"] > 0.9  # the model drafts itself
    key = "2 parts + speculation ahead vs 2 parts + speculation"
    assert report["ratios"][key] > 0 and key in report["spread"]
    assert BENCHES["ahead"].keywords({"spec_k": 2, "cpus": "0;1"}) | {"model": folder} == {
        "model": folder, "draft": BENCHES["ahead"].keywords({})["draft"], "k": 2, "cpu_sets": "0;1"}


def test_a_round_goes_ahead_where_its_chance_pays_for_a_discarded_one():
    gate = AheadGate()
    assert gate.opens(False, [10.0, 10.0])  # equal stages: a discarded round costs nothing
    assert not gate.opens(False, [10.0])  # one stage: nothing to hide a round behind
    for _ in range(20):  # kept after a full acceptance, discarded after a partial one
        gate.learn(True, True)
        gate.learn(False, False)
    assert gate.chance(True) > 0.9 > 0.1 > gate.chance(False)
    assert gate.opens(True, [5.0, 20.0])  # the later stage costs 15 ms more, but the round is nearly always kept
    held = [gate.opens(False, [5.0, 20.0]) for _ in range(AheadGate.EXPLORE + 1)]
    assert held == [False] * AheadGate.EXPLORE + [True]  # held back, but tried now and then
    assert gate.opens(False, [5.0, 3.0], network_ms=4.0)  # a slow stage 0: a discarded round costs nothing
    fresh = AheadGate()
    assert fresh.opens(False, [10.0, 10.0], draft_ms=1.0)
    assert not fresh.opens(False, [10.0, 10.0], draft_ms=12.0)  # drafting ahead takes longer than stage 1
    for _ in range(20):
        fresh.learn(False, False)
    assert not fresh.opens(False, [10.0, 10.0], draft_ms=3.0)  # a discarded round costs its drafting
