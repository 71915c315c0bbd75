"""The benchmark registry (``engine.bench.registry``) that ``fleet bench`` and the app's Benchmarks view
read: every option a benchmark takes reaches a keyword its run function has, every ``fleet bench``
flag is an option some benchmark takes, and the app gives each of its benchmarks what it runs with."""

from __future__ import annotations

import importlib
import inspect

import pytest

from engine.bench.registry import BENCHES, DRAFT_MODEL
from engine.cli.bench import OPTIONS

APP_ONLY = {"shards", "k"}  # options the app gives and no flag does


def parameters(bench) -> dict:
    module = importlib.import_module(f"engine.bench.{bench.name}")
    return inspect.signature(getattr(module, f"run_{bench.name}")).parameters


@pytest.mark.parametrize("name", list(BENCHES))
def test_every_option_reaches_a_keyword_of_the_run_function(name):
    bench = BENCHES[name]
    taken = parameters(bench)
    keywords = {keyword for keyword, _ in bench.options.values()} | {"log"}
    if bench.plot:  # in the app: followed through hooks, and given what the app fixes
        keywords |= {"hooks", *bench.app}
    assert keywords <= set(taken), keywords - set(taken)
    assert set(bench.notes) <= set(bench.options)
    assert ("model" in taken) == (bench.model is not None)


def test_flags_and_options_are_the_same_names():
    flags = {flag[2:].replace("-", "_") for flag in OPTIONS}
    options = {option for bench in BENCHES.values() for option in bench.options}
    assert options - APP_ONLY == flags


def test_keywords_rename_convert_and_default():
    soak, quality, wan = BENCHES["soak"], BENCHES["quality"], BENCHES["wan"]
    assert soak.keywords({"users": (2, 8, 4), "stages": None, "kill_every": 5.0}) == {
        "model": soak.model, "users": 8, "kill_every_s": 5.0}
    assert quality.keywords({"formats": ("int4",), "stages": 2, "weights": "int8"}) == {
        "model": quality.model, "weights": ("int4",), "stages": (2,)}
    assert wan.keywords({"model": "m", "draft": None, "device": "GPU", "json": "out.json"}) == {
        "model": "m", "draft": DRAFT_MODEL, "out": "out.json"}


def test_the_microbatch_plot_leaves_out_its_side_by_side_rows():
    from engine.bench.microbatch import COMPARISONS

    assert set(BENCHES["microbatch"].plot.skip) == set(COMPARISONS)
