"""Model cards' figures: the catalog's facts against the real GGUF headers, and whether a model fits
this PC and the fleet with its predicted speed (engine.fleet.fit) over a synthetic fleet profile."""

from __future__ import annotations

import json
import types

import pytest

from engine.fleet import fit
from engine.fleet.layout import solve_layout
from engine.fleet.placement import GB, DeviceProfile, Fleet, solve, stage_memory
from engine.models.catalog import CATALOG, is_cached
from engine.models.facts import catalog_facts, facts_of, gguf_facts

SHAPE_FIELDS = ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "context", "weight_format")


def write_gguf(path, *, license="mit"):
    """A two-layer llama GGUF header with the keys a card reads (and two small tensors)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(1000)
    writer.add_license(license)
    writer.add_file_type(1)
    writer.add_tensor("a", np.zeros((10, 20), dtype=np.float32))
    writer.add_tensor("b", np.ones(30, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def profile_doc(source="qwen2.5-coder-0.5b", memory_gb=(1.0, 1.5, 1.5)) -> dict:
    """A fleet profile as `fleet profile` writes it: three PCs, "a" the coordinator."""
    shape = fit.estimate_shape(catalog_facts(CATALOG[source]), weights="int4")
    devices = [DeviceProfile(n, "CPU", int(m * GB), 1.0, 5.0, embed_ms=0.1, prefill_layer_ms=0.2, call_ms=0.3)
               for n, m in zip("abc", memory_gb)]
    fleet = Fleet(devices, {("a", "b"): 0.5, ("a", "c"): 0.5, ("b", "c"): 0.5}, coordinator="a")
    return {"model": shape.to_json(), "nodes": {n: {"name": f"pc-{n}", "address": "x"} for n in "abc"},
            "fleet": fleet.to_json(), "source": source, "weights": "int4",
            "taken": {"devices": ["CPU"], "context": 4096, "streams": 1, "agents": {}, "at": 0}}


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "fleet-profile.json"
    path.write_text(json.dumps(profile_doc()))
    return fit.load_profile(path)


@pytest.mark.parametrize("name", list(CATALOG))
def test_catalog_facts_match_the_gguf_headers(name):
    e = CATALOG[name]
    facts = catalog_facts(e)
    assert facts.parameters > 0 and facts.license and facts.has_shape
    if not is_cached(e):
        pytest.skip(f"{name} is not pulled on this machine")
    header = gguf_facts(e.path)
    assert {f: getattr(header, f) for f in SHAPE_FIELDS} == {f: getattr(facts, f) for f in SHAPE_FIELDS}
    assert header.size == e.size


def test_gguf_facts_read_the_header(tmp_path):
    facts = facts_of(write_gguf(tmp_path / "tiny.gguf"))
    assert (facts.kind, facts.name, facts.num_layers, facts.context, facts.license, facts.parameters) == \
           ("gguf", "tiny test llama", 2, 2048, "mit", 230)
    assert (facts.num_heads, facts.num_kv_heads, facts.head_dim, facts.weight_format) == (4, 2, 16, "GGUF F16")
    (tmp_path / "bad.gguf").write_bytes(b"nope")
    with pytest.raises(Exception, match="not a GGUF file"):
        facts_of(tmp_path / "bad.gguf")


def test_a_model_too_big_for_one_pc_needs_two(profile):
    big = fit.predict(catalog_facts(CATALOG["qwen2.5-coder-1.5b"]), profile)
    assert big.estimated_shape and not big.fits_here and big.here_bytes == GB
    assert 1.0 * GB < big.need_bytes < 2.5 * GB
    assert (big.fleet_pcs, big.pcs_needed) == (3, 2)
    small = fit.predict(catalog_facts(CATALOG["smollm2-135m"]), profile)
    assert small.fits_here and small.pcs_needed == 1


def test_the_predictions_are_the_solvers(profile):
    """The profiled model is priced on the profile as it is; another on the timings scaled by its bytes."""
    same = fit.predict(catalog_facts(CATALOG["qwen2.5-coder-0.5b"]), profile)
    assert not same.estimated_shape
    assert same.tok_s_1 == pytest.approx(solve(profile.shape, profile.fleet, objective="latency").tok_s)
    assert same.tok_s_users == pytest.approx(solve_layout(profile.shape, profile.fleet, users=4).aggregate_tok_s)

    facts = catalog_facts(CATALOG["qwen2.5-coder-1.5b"])
    other = fit.predict(facts, profile)
    shape = fit.estimate_shape(facts, weights="int4")
    fleet = fit.scaled_fleet(profile.fleet, profile.shape, shape)
    assert fleet.devices[0].layer_ms == pytest.approx(shape.layer_bytes / profile.shape.layer_bytes)
    assert other.tok_s_users == pytest.approx(solve_layout(shape, fleet, users=4).aggregate_tok_s)
    assert other.tok_s_1 == pytest.approx(solve(shape, fleet, objective="latency").tok_s)
    assert other.tok_s_1 < same.tok_s_1  # three times the weights to read


def test_a_fleet_that_cannot_hold_the_model(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_doc(memory_gb=(0.5, 0.4, 0.4))))
    result = fit.predict(catalog_facts(CATALOG["qwen2.5-coder-1.5b"]), fit.load_profile(path))
    assert result.pcs_needed is None and result.tok_s_1 is None and "needs" in result.note


def test_without_a_profile_only_this_pc_is_known():
    facts = catalog_facts(CATALOG["smollm2-135m"])
    need = stage_memory(fit.estimate_shape(facts, weights="int4")).at(30, True, True)
    fits = fit.predict(facts, None, weights="int4", available_bytes=int(need) + 1)
    assert fits.fits_here and fits.tok_s_1 is None and fits.note == fit.NO_PROFILE and fits.fleet_pcs == 0
    assert not fit.predict(facts, None, weights="int4", available_bytes=int(need) - 1).fits_here


def test_measured_speeds_are_kept_per_model(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    assert fit.measured_tok_s("smollm2-135m") is None
    fit.record_measured("smollm2-135m", 23.42)
    fit.record_measured("smollm2-135m", 0)  # an empty reply measures nothing
    assert fit.measured_tok_s("smollm2-135m") == 23.42
    assert fit.measured_key("smollm2-135m") == "smollm2-135m"
    assert fit.measured_key(str(tmp_path)) == str(tmp_path)  # not a shard set: known by its path
    # a deployment's first stage: its model's name, unless the stage is an export of a catalog model
    assert fit.measured_key(str(tmp_path), "my-model") == "my-model"
    assert fit.measured_key("smollm2-135m", "my-model") == "my-model"


def test_a_deployed_export_of_a_catalog_model_counts_as_that_model(monkeypatch, tmp_path):
    entry = next(iter(CATALOG.values()))
    stage = tmp_path / "stage0"
    stage.mkdir()
    monkeypatch.setattr(fit, "is_shard_set", lambda source: True)
    monkeypatch.setattr(fit, "load_manifest", lambda path: types.SimpleNamespace(fingerprint=entry.sha256))
    (stage / fit.MANIFEST).write_text("{}")
    assert fit.measured_key(str(stage), "deployed-name") == entry.name
