"""The placement solver against hand-checked fleets and a brute-force enumerator; evaluate and JSON."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
import time

import pytest

from engine.errors import FleetError
from engine.fleet.placement import (
    GB, DeviceProfile, Evaluation, Fleet, Infeasible, ModelShape, Pin, Plan, PlacementError, balanced_split, evaluate,
    even_split,
    aggregate_tok_s, left_out, simulated_fleet, solve,
)


def model(layers=8, layer_gb=1.0, embed_gb=0.0, head_gb=0.0, kv_gb=0.0, overhead_gb=0.0):
    return ModelShape("m", layers, layer_bytes=int(layer_gb * GB), embed_bytes=int(embed_gb * GB),
                      head_bytes=int(head_gb * GB), kv_bytes_per_layer=int(kv_gb * GB),
                      overhead_bytes=int(overhead_gb * GB))


def dev(node, device="CPU", mem_gb=64.0, layer_ms=1.0, head_ms=0.0, embed_ms=0.0, supported=True):
    return DeviceProfile(node, device, int(mem_gb * GB), layer_ms, head_ms, embed_ms=embed_ms, supported=supported)


def fleet(*devices, rtt=1.0, coordinator=None):
    nodes = list(dict.fromkeys(d.node for d in devices))
    return Fleet(list(devices), {(a, b): rtt for a, b in itertools.combinations(nodes, 2)}, coordinator)


def chain(plan):
    return [(s.node, s.device, s.start, s.end) for s in plan.stages]


# ---- infeasible fleets and bad pins ----

def test_total_memory_too_small():
    f = fleet(dev("a", mem_gb=3), dev("b", mem_gb=3))
    with pytest.raises(Infeasible, match=r"the model needs 8\.0 GB \(weights \+ KV\) but the fleet's usable "
                                         r"devices hold 6\.0 GB"):
        solve(model(8), f)


def test_total_memory_counts_one_device_per_node_and_kv():
    # node a's two devices cannot both take a stage, so only its larger one counts
    f = fleet(dev("a", "CPU", mem_gb=4), dev("a", "GPU.0", mem_gb=3), dev("b", mem_gb=4))
    with pytest.raises(Infeasible, match=r"needs 10\.0 GB .* hold 8\.0 GB"):
        solve(model(5, layer_gb=1.5, kv_gb=0.5), f)


def test_pin_too_big_for_its_device():
    f = fleet(dev("a", mem_gb=4), dev("b", mem_gb=64))
    with pytest.raises(Infeasible, match=r"^pin of layers 0-5 on node a needs 6\.0 GB, its CPU has 4\.0 GB$"):
        solve(model(8), f, pins=[Pin("a", 0, 6)])


def test_overlapping_pins():
    f = fleet(dev("a"), dev("b"), dev("c"))
    with pytest.raises(Infeasible, match=r"^pins overlap: layers 0-3 on a and layers 3-5 on b$"):
        solve(model(8), f, pins=[Pin("b", 3, 6), Pin("a", 0, 4)])


def test_pin_argument_names_layers_inclusively():
    import argparse

    from engine.cli.fleet import _pin

    assert _pin("alpha:0-14") == Pin("alpha", 0, 15)
    assert _pin("this PC:3:GPU.1") == Pin("this PC", 3, 4, "GPU.1")
    for bad in ("alpha:5-3", "alpha", "alpha:x-3", "alpha:1-2:GPU:NPU"):
        with pytest.raises(argparse.ArgumentTypeError, match="both included"):
            _pin(bad)


@pytest.mark.parametrize("pins, reason", [
    ([Pin("a", 4, 9)], "pin of layers 4-8 on node a lies outside the model's layers 0-7"),
    ([Pin("a", 5, 5)], "a pin on node a holds no layers"),
    ([Pin("zz", 0, 4)], "pin of layers 0-3 on node zz: unknown node"),
    ([Pin("a", 0, 4, "NPU")], "pin of layers 0-3 on node a: the node has no device NPU"),
    ([Pin("c", 0, 4, "GPU.0")], "pin of layers 0-3 on node c: its GPU.0 cannot run a part"),
    ([Pin("a", 0, 2), Pin("a", 4, 6)], "node a is pinned twice"),
    ([Pin("a", 1, 2), Pin("b", 3, 4)],
     r"the pins leave 3 unpinned range\(s\) \(layer 0; layer 2; layers 4-7\) but only 1 other"),
])
def test_bad_pins_are_refused_before_solving(pins, reason):
    f = fleet(dev("a"), dev("b"), dev("c"), dev("c", "GPU.0", supported=False))
    with pytest.raises(Infeasible, match=reason):
        solve(model(8), f, pins=pins)


def test_pins_and_max_stages():
    f = fleet(dev("a"), dev("b"), dev("c"))
    with pytest.raises(Infeasible, match="the pins need at least 3 parts but at most 2 are allowed"):
        solve(model(8), f, pins=[Pin("a", 3, 5)], max_stages=2)


def test_no_supported_device_and_unknown_coordinator():
    with pytest.raises(Infeasible, match="no device in the fleet is supported"):
        solve(model(8), fleet(dev("a", supported=False)))
    with pytest.raises(Infeasible, match="coordinator zz is not in the fleet"):
        solve(model(8), fleet(dev("a"), coordinator="zz"))
    with pytest.raises(Infeasible, match=r"coordinator a must run part 1 \(embedding and at least one layer, "
                                         r"3\.0 GB\) but its CPU has 2\.0 GB"):
        solve(model(8, embed_gb=2), fleet(dev("a", mem_gb=2), dev("b"), coordinator="a"))


def test_infeasible_only_the_solver_can_see():
    # 3 layers need 3 GB and the fleet holds 3 GB, but each device fits only one whole layer
    f = fleet(dev("a", mem_gb=1.5), dev("b", mem_gb=1.5))
    with pytest.raises(Infeasible, match="no placement fits .* proved every combination infeasible"):
        solve(model(3), f)


def test_missing_rtt_names_the_pair():
    f = Fleet([dev("a"), dev("b"), dev("c")], {("a", "b"): 1.0, ("c", "a"): 1.0})
    with pytest.raises(PlacementError, match="no round-trip time measured between b and c"):
        solve(model(8), f)
    assert f.rtt("a", "c") == f.rtt("c", "a") == 1.0 and f.rtt("b", "b") == 0.0
    problems = evaluate(model(8), f, [("b", "CPU", 0, 4), ("c", "CPU", 4, 8)]).problems
    assert problems == ["no round-trip time measured between b and c"]
    assert issubclass(Infeasible, FleetError) and issubclass(PlacementError, FleetError)


# ---- what the solver chooses ----

def test_pins_are_respected_and_the_rest_filled():
    # b is the slowest node; unpinned, the solver would not give it layers
    f = fleet(dev("a", layer_ms=1.0, mem_gb=6), dev("b", layer_ms=5.0), dev("b", "GPU.0", layer_ms=9.0),
              dev("c", layer_ms=1.0, mem_gb=6), dev("d", layer_ms=1.0, mem_gb=6))
    assert "b" not in {s.node for s in solve(model(12), f).stages}
    plan = solve(model(12), f, pins=[Pin("b", 4, 8, "GPU.0")])
    assert ("b", "GPU.0", 4, 8) in chain(plan)
    assert evaluate(model(12), f, chain(plan)).problems == []
    plan = solve(model(12), f, pins=[Pin("b", 10, 12), Pin("a", 0, 3)])
    assert chain(plan)[0] == ("a", "CPU", 0, 3) and chain(plan)[-1] == ("b", "CPU", 10, 12)
    assert evaluate(model(12), f, chain(plan)).problems == []


def test_fast_small_gpu_and_slow_large_cpu_are_both_used():
    f = fleet(dev("laptop", "GPU.0", mem_gb=3, layer_ms=0.5, head_ms=1.0),
              dev("laptop", "CPU", layer_ms=4.0, head_ms=8.0),
              dev("desk", "CPU", layer_ms=3.0, head_ms=6.0), rtt=1.0)
    plan = solve(model(10), f)
    # the GPU takes all it can hold, and goes last so the head runs there too; the desk CPU takes the rest
    assert chain(plan) == [("desk", "CPU", 0, 7), ("laptop", "GPU.0", 7, 10)]
    assert plan.token_ms == pytest.approx(7 * 3.0 + 3 * 0.5 + 1.0 + 1.0)
    assert plan.stages[1].memory_bytes == 3 * GB == plan.stages[1].memory_limit_bytes


def test_coordinator_runs_stage_zero():
    f = fleet(dev("a", mem_gb=5, layer_ms=2.0, embed_ms=0.5), dev("b", mem_gb=5, layer_ms=1.0, embed_ms=0.5),
              dev("c", mem_gb=5, layer_ms=1.0, head_ms=0.5))
    free = solve(model(8), f)
    assert free.stages[0].node != "a"
    f = fleet(*f.devices, coordinator="a")
    plan = solve(model(8), f)
    assert plan.stages[0].node == "a" and evaluate(model(8), f, chain(plan)).problems == []
    assert plan.token_ms > free.token_ms
    problems = evaluate(model(8), f, chain(free)).problems
    assert problems == [f"part 1 must run on the coordinator a, not {free.stages[0].node}"]


def test_throughput_splits_where_latency_does_not():
    f = fleet(dev("a", layer_ms=1.0, head_ms=2.0), dev("b", layer_ms=1.0, head_ms=2.0), rtt=2.0)
    fast = solve(model(8), f, objective="latency", users=4)
    wide = solve(model(8), f, objective="throughput", users=4)
    assert len(fast.stages) == 1 and fast.token_ms == 10.0
    assert len(wide.stages) == 2 and wide.aggregate_tok_s > fast.aggregate_tok_s
    assert wide.token_ms > fast.token_ms
    # one user: throughput is latency again
    assert len(solve(model(8), f, objective="throughput", users=1).stages) == 1


def test_a_slow_pc_gets_fewer_layers_or_none_and_the_reason_says_what_a_layer_there_would_cost():
    """Two PCs of 0.9 of a core and one of 0.2 (a layer 4.5x as slow): one user's plan leaves the
    slow one out, and says what its best single layer would do; for 4 users it takes fewer layers
    than either fast PC.  A PC too small for a layer and one with no supported device are named with
    their own reasons."""
    shape = model(28, layer_gb=0.025, head_gb=0.25, kv_gb=0.004, overhead_gb=0.2)
    f = fleet(dev("pc1", mem_gb=0.9, layer_ms=1.1, head_ms=10.0), dev("pc2", mem_gb=0.9, layer_ms=1.1, head_ms=10.0),
              dev("slow", mem_gb=0.9, layer_ms=5.0, head_ms=45.0), dev("tiny", mem_gb=0.1),
              dev("npu", "NPU", supported=False), rtt=0.3, coordinator="pc1")
    plan = solve(shape, f)
    assert {s.node for s in plan.stages} == {"pc1", "pc2"}, plan.explain()
    reasons = left_out(shape, f, plan)
    assert set(reasons) == {"slow", "tiny", "npu"}
    assert reasons["npu"] == "none of its devices can run a part"
    assert reasons["tiny"].startswith("it cannot hold one layer")
    assert "its CPU takes 5.00 ms a layer (the plan's slowest 1.10 ms)" in reasons["slow"]
    worse, now = (float(x) for x in re.search(r"would take ([\d.]+) ms instead of ([\d.]+)", reasons["slow"]).groups())
    assert worse > now == round(plan.token_ms, 2)
    wide = solve(shape, f, objective="throughput", users=4)  # every row costs a whole step (no prefill measured)
    layers = {s.node: s.end - s.start for s in wide.stages}
    assert 0 < layers["slow"] < min(layers["pc1"], layers["pc2"]), wide.explain()
    assert set(left_out(shape, f, wide)) == {"tiny", "npu"}
    # devices that read their weights once a step, a packed row adding a tenth (as measured CPUs do):
    # 4 users packed on the two fast PCs beat a third, slow stage
    packed = Fleet([dataclasses.replace(d, prefill_layer_ms=d.layer_ms / 10) for d in f.devices], f.rtt_ms, "pc1")
    wide = solve(shape, packed, objective="throughput", users=4)
    assert {s.node for s in wide.stages} == {"pc1", "pc2"}, wide.explain()
    assert "would get" in left_out(shape, packed, wide)["slow"]


def test_packed_rows_cost_their_share_of_a_step():
    """One stage, 4 users: rows that cost nothing give 4x one user's tok/s, rows that cost a whole step
    1x; with two stages, groups in flight keep both busy."""
    free = dev("a", layer_ms=1.0, head_ms=0.0)
    one = dataclasses.replace(free, prefill_layer_ms=1e-9)
    assert aggregate_tok_s([(one, 10, True, True)], 0.0, 4) == pytest.approx(4 * 100.0)
    assert aggregate_tok_s([(free, 10, True, True)], 0.0, 4) == pytest.approx(100.0)
    half = dataclasses.replace(free, prefill_layer_ms=0.5)  # a row adds half a step: 4 rows cost 2.5 steps
    assert aggregate_tok_s([(half, 10, True, True)], 0.0, 4) == pytest.approx(4000 / 25)
    # two stages of 5 layers, 2 groups of 2 rows: a trip 2 x 7.5 ms, each stage 2 x 7.5 ms a cycle
    assert aggregate_tok_s([(half, 5, True, False), (half, 5, False, True)], 0.0, 4) == pytest.approx(4000 / 15)


def test_ties_prefer_fewer_stages():
    f = fleet(*(dev(n) for n in "abcdefgh"), rtt=0.0)
    assert len(solve(model(6), f).stages) == 1
    # free hops and equal nodes: every split whose largest stage is 3 (or 2) layers ties
    # (HiGHS alone returns 6 and 8 stages here)
    assert [s.end - s.start for s in solve(model(12), f, objective="throughput", users=4).stages] == [3] * 4
    assert [s.end - s.start for s in solve(model(12), f, objective="throughput", users=8).stages] == [2] * 6
    f = fleet(*(dev(n, mem_gb=3) for n in "abcdefgh"), rtt=0.0)
    assert [s.end - s.start for s in solve(model(12), f).stages] == [3] * 4


def test_max_stages():
    f = fleet(dev("a", mem_gb=5), dev("b", mem_gb=5), dev("c", mem_gb=5), rtt=0.5)
    assert len(solve(model(9), f, objective="throughput", users=3).stages) == 3
    assert len(solve(model(9), f, objective="throughput", users=3, max_stages=2).stages) == 2
    with pytest.raises(Infeasible, match="in at most 1 part$"):
        solve(model(9), f, max_stages=1)


# ---- optimality against brute force ----

def brute_force(m, f, objective, users, pins):
    """Best objective and the fewest stages reaching it, over every ordered node subset, device choice
    and composition of the layers, priced by the brief's formulas (written apart from the module)."""
    L = m.num_layers
    by_node = {}
    for d in f.devices:
        if d.supported:
            by_node.setdefault(d.node, []).append(d)
    pin_of = {p.node: p for p in pins}
    best = None
    for k in range(1, min(len(by_node), L) + 1):
        for order in itertools.permutations(by_node, k):
            if f.coordinator is not None and order[0] != f.coordinator:
                continue
            if any(n not in order for n in pin_of):
                continue
            net = sum(f.rtt(a, b) for a, b in zip(order, order[1:]))
            for devs in itertools.product(*(by_node[n] for n in order)):
                if any(n in pin_of and pin_of[n].device not in (None, d.device) for n, d in zip(order, devs)):
                    continue
                for cuts in itertools.combinations(range(1, L), k - 1):
                    edges = (0, *cuts, L)
                    times, ok = [], True
                    for s, d in enumerate(devs):
                        a, b = edges[s], edges[s + 1]
                        first, last = s == 0, s == k - 1
                        pin = pin_of.get(d.node)
                        mem = ((b - a) * (m.layer_bytes + m.kv_bytes_per_layer) + m.embed_bytes * first
                               + m.head_bytes * last + m.overhead_bytes)
                        if mem > d.memory_bytes or (pin and (pin.start, pin.end) != (a, b)):
                            ok = False
                            break
                        times.append((b - a) * d.layer_ms + d.embed_ms * first + d.head_ms * last)
                    if not ok:
                        continue
                    token = sum(times) + net
                    value = token if objective == "latency" else max(token / users, max(times))
                    if best is None or value < best[0] * (1 - 1e-9) or (value <= best[0] * (1 + 1e-9) and k < best[1]):
                        best = (value, k)
    return best


def random_case(seed):
    rng = random.Random(seed)
    L = rng.randint(6, 10)
    m = ModelShape("r", L, layer_bytes=rng.randint(5, 15) * 10**8, embed_bytes=rng.randint(0, 10) * 10**8,
                   head_bytes=rng.randint(0, 10) * 10**8, kv_bytes_per_layer=rng.randint(0, 3) * 10**8,
                   overhead_bytes=rng.randint(0, 3) * 10**8)
    devices = []
    for n in range(rng.randint(3, 4)):
        for name in ("CPU", "GPU.0")[:rng.randint(1, 2)]:
            devices.append(DeviceProfile(f"n{n}", name, rng.randint(15, 90) * 10**8, rng.uniform(0.5, 5),
                                         rng.uniform(0, 10), embed_ms=rng.uniform(0, 1),
                                         supported=rng.random() < 0.9))
    nodes = list(dict.fromkeys(d.node for d in devices))
    rtt = {(a, b): rng.uniform(0.1, 3) for a, b in itertools.combinations(nodes, 2)}
    coordinator = rng.choice(nodes) if rng.random() < 0.3 else None
    pins = []
    for node in rng.sample(nodes, 2):
        if rng.random() < 0.25:
            a = rng.randrange(L)
            pins.append(Pin(node, a, rng.randint(a + 1, min(L, a + 4)), rng.choice((None, "CPU"))))
    if len(pins) == 2 and pins[0].start < pins[1].end and pins[1].start < pins[0].end:
        pins.pop()  # overlapping pins are refused before solving, tested on their own
    return m, Fleet(devices, rtt, coordinator), pins, rng.randint(1, 4)


@pytest.mark.parametrize("seed", range(32))
def test_optimal_against_brute_force(seed):
    m, f, pins, users = random_case(seed)
    for objective in ("latency", "throughput"):
        expected = brute_force(m, f, objective, users, pins)
        if expected is None:
            with pytest.raises(Infeasible):
                solve(m, f, objective=objective, users=users, pins=pins)
            continue
        plan = solve(m, f, objective=objective, users=users, pins=pins)
        assert evaluate(m, f, chain(plan), users=users).problems == []
        value = plan.token_ms if objective == "latency" else 1000 / plan.aggregate_tok_s
        assert value == pytest.approx(expected[0], rel=1e-6), (objective, chain(plan))
        assert len(plan.stages) == expected[1]
        for p in pins:
            assert any((s.node, s.start, s.end) == (p.node, p.start, p.end) for s in plan.stages)


def test_two_pins_against_brute_force():
    f = fleet(dev("a", mem_gb=3, layer_ms=0.5, head_ms=1), dev("b", layer_ms=2, embed_ms=1), dev("c", layer_ms=3),
              dev("d", mem_gb=4, layer_ms=1), dev("d", "GPU.0", mem_gb=2, layer_ms=0.3, head_ms=0.5),
              dev("e", layer_ms=4, head_ms=3), rtt=0.7)
    pins = [Pin("b", 2, 4), Pin("c", 6, 8)]
    for objective, users in (("latency", 1), ("throughput", 3)):
        plan = solve(model(10), f, objective=objective, users=users, pins=pins)
        assert ("b", "CPU", 2, 4) in chain(plan) and ("c", "CPU", 6, 8) in chain(plan)
        value = plan.token_ms if objective == "latency" else 1000 / plan.aggregate_tok_s
        assert (value, len(plan.stages)) == pytest.approx(brute_force(model(10), f, objective, users, pins))


def test_random_cases_include_infeasible_ones():
    cases = [random_case(seed) for seed in range(32)]
    feasible = [brute_force(m, f, "latency", users, pins) is not None for m, f, pins, users in cases]
    assert any(feasible) and not all(feasible)


# ---- evaluate ----

def test_evaluate_reports_memory_gaps_overlaps_and_unknowns():
    f = fleet(dev("a", mem_gb=4), dev("b", mem_gb=4))
    problems = evaluate(model(10), f, [("a", "CPU", 0, 3), ("b", "CPU", 3, 8)]).problems
    assert problems == ["part 2 on b CPU needs 5.0 GB but has 4.0 GB: 1.0 GB over",
                        "gap: layers 8-9 in no part"]
    problems = evaluate(model(10), f, [("a", "CPU", 0, 3), ("b", "CPU", 4, 8), ("a", "CPU", 7, 10)]).problems
    assert problems == ["gap: layer 3 in no part",
                        "overlap: layer 7 of part 3 already in an earlier part"]
    problems = evaluate(model(10), f, [("zz", "CPU", 0, 5), ("a", "NPU", 5, 10)]).problems
    assert "part 1: unknown node zz" in problems and "part 2: node a has no device NPU" in problems
    assert evaluate(model(10), f, []).problems == ["the plan has no parts"]
    problems = evaluate(model(8), f, [("a", "CPU", 1, 4), ("b", "CPU", 4, 8)]).problems
    assert problems == ["gap: layer 0 in no part"]


def test_evaluate_allows_one_node_in_several_stages():
    f = Fleet([dev("a", layer_ms=1.0, head_ms=2.0)], {("a", "a"): 0.25})
    ev = evaluate(model(6), f, [("a", "CPU", 0, 2), ("a", "CPU", 2, 4), ("a", "CPU", 4, 6)], users=3)
    assert ev.ok and ev.plan.network_ms == 0.5
    assert ev.plan.token_ms == 6 + 2 + 0.5
    assert ev.plan.aggregate_tok_s == pytest.approx(1000 * min(3 / 8.5, 1 / 4))


def test_evaluate_equals_solve_for_the_solved_plan():
    m = model(80, layer_gb=0.2, embed_gb=0.5, head_gb=0.5, kv_gb=0.04, overhead_gb=0.3)
    f = simulated_fleet(6, seed=3)
    for objective, users in (("latency", 1), ("throughput", 4)):
        plan = solve(m, f, objective=objective, users=users)
        ev = evaluate(m, f, chain(plan), users=users)
        assert ev.problems == []
        assert ev.plan.stages == plan.stages
        for field in ("network_ms", "token_ms", "tok_s", "aggregate_tok_s", "users", "model"):
            assert getattr(ev.plan, field) == getattr(plan, field)


def test_explain():
    f = fleet(dev("a", mem_gb=8, layer_ms=1.0), dev("b", "GPU.0", mem_gb=8, layer_ms=1.0, head_ms=1.0), rtt=2.0)
    plan = solve(model(10), f, objective="throughput", users=2)
    text = plan.explain()
    assert "a CPU, layers " in text and "b GPU.0, layers " in text and "of 8.0 GB (" in text
    assert "network: 2.00 ms per token over 1 hop(s)" in text
    assert f"{plan.aggregate_tok_s:.1f} tok/s aggregate for 2 user(s)" in text


# ---- JSON ----

def test_json_round_trips():
    m = model(8, embed_gb=0.5, kv_gb=0.1, overhead_gb=0.2)
    devices = [dev("a", mem_gb=6, embed_ms=0.1), dev("b", "GPU.0", mem_gb=6, supported=False), dev("b")]
    f = Fleet(devices, {("b", "a"): 1.5, ("a", "a"): 0.1}, coordinator="a")
    for obj in (m, f, Pin("a", 0, 3), Pin("b", 3, 8, "CPU")):
        assert type(obj).from_json(json.loads(json.dumps(obj.to_json()))) == obj
    doc = f.to_json()
    assert sorted(doc["rtt"], key=lambda r: r["ms"]) == [{"a": "a", "b": "a", "ms": 0.1},
                                                         {"a": "b", "b": "a", "ms": 1.5}]
    assert Fleet.from_json(doc).rtt("a", "b") == 1.5
    plan = solve(m, f, pins=[Pin("b", 4, 8)])
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    ev = evaluate(m, f, [("a", "CPU", 0, 8)])
    assert Evaluation.from_json(json.loads(json.dumps(ev.to_json()))) == ev


# ---- scale ----

def test_sixteen_nodes_on_an_80_layer_model():
    m = model(80, layer_gb=0.2, embed_gb=0.5, head_gb=0.5, kv_gb=0.04, overhead_gb=0.3)
    f = simulated_fleet(16, seed=0)
    assert len(f.nodes) == 16
    for objective, users in (("latency", 1), ("throughput", 16)):
        began = time.perf_counter()
        plan = solve(m, f, objective=objective, users=users)
        print(f"16 nodes, 80 layers, {objective} ({users} users): {len(plan.stages)} stages in "
              f"{time.perf_counter() - began:.2f} s")
        assert evaluate(m, f, chain(plan), users=users).problems == []


# ---- the deployment's rules (engine.fleet.deploy.check_placement), which the app's plan asks too ----

def test_check_placement_refuses_what_deploy_cannot_run():
    from engine.fleet.deploy import LOCAL, check_placement, placement_problem
    from engine.fleet.span import StageSpan

    def stages(*spec):
        return [StageSpan(agent, "CPU", start, end) for agent, start, end in spec]

    a, b = "10.0.0.2:7411", "10.0.0.3:7411"
    for good in (stages((LOCAL, 0, 1), (a, 1, 3), (b, 3, 4)), stages((a, 0, 4)), stages((a, 0, 2), (b, 2, 4))):
        check_placement(good)  # stage 0 here, or every stage on a node (this machine feeds them)
        assert placement_problem(good) is None
    for bad, message in [
        ([], "a placement needs at least one part"),
        (stages((a, 0, 2), (LOCAL, 2, 4)), "part 2 (layers 2-3) is on this PC: only part 1 runs in the "
                                            "coordinator"),
        (stages((LOCAL, 0, 4)), "a deployment needs at least one part on a node agent"),
        (stages((LOCAL, 0, 1), (a, 1, 3), (LOCAL, 3, 4)),
         "part 3 (layer 3) is on this PC: only part 1 runs in the coordinator, later parts need a node "
         "agent's address"),
        (stages((LOCAL, 0, 1), (LOCAL, 1, 3), (LOCAL, 3, 4)), "part 2 (layers 1-2), part 3 (layer 3) are on this "
                                                               "PC"),
        (stages((LOCAL, 1, 2), (a, 2, 4)), "the first part starts at layer 1, not 0"),
        (stages((LOCAL, 0, 2), (a, 2, 2), (b, 2, 4)), "the part from layer 2 holds no layers"),
        (stages((LOCAL, 0, 2), (a, 3, 4)), "the parts of layers 0-1 and layer 3 are not contiguous"),
        (stages((LOCAL, 0, 3), (a, 2, 4)), "the parts of layers 0-2 and layers 2-3 are not contiguous"),
    ]:
        with pytest.raises(FleetError) as raised:
            check_placement(bad)
        assert str(raised.value).startswith(message), bad
        assert placement_problem(bad) == str(raised.value)


def test_an_even_split_gives_each_stage_the_same_weights_to_read():
    """The head is read whole by the last stage (Qwen2.5-Coder-1.5B's INT8 head weighs ten INT4
    layers), the embedding is a lookup: 2 stages of 28 layers part at 19, not 14."""
    qwen = ModelShape("qwen", 28, layer_bytes=24_127_488, embed_bytes=240_666_624, head_bytes=240_666_624,
                      kv_bytes_per_layer=1)
    assert even_split(qwen, 2) == [19] and even_split(qwen, 3) == [13, 25]
    light = ModelShape("light", 8, layer_bytes=100, embed_bytes=0, head_bytes=0, kv_bytes_per_layer=1)
    assert even_split(light, 2) == [4] and even_split(light, 4) == [2, 4, 6]
    heavy = ModelShape("heavy", 3, layer_bytes=1, embed_bytes=0, head_bytes=1000, kv_bytes_per_layer=1)
    assert even_split(heavy, 3) == [1, 2]  # every stage keeps at least one layer


def test_a_balanced_split_gives_each_stage_the_same_measured_time():
    """Measured on a CPU that computes in float (AVX2 only), Qwen2.5-Coder-1.5B's head costs about 5
    layers, not the 10 its bytes say: the boundary that balances the stages' time is 17, not 19."""
    qwen = ModelShape("qwen", 28, layer_bytes=24_127_488, embed_bytes=240_666_624, head_bytes=240_666_624,
                      kv_bytes_per_layer=1)
    avx2 = DeviceProfile("pc", "CPU", 8 * GB, layer_ms=11.53, head_ms=58.8)
    assert balanced_split(qwen, avx2, 2) == [17]
    assert balanced_split(qwen, avx2, 1) == []
    # a head as costly as its bytes: the even split's boundaries
    by_bytes = DeviceProfile("pc", "CPU", 8 * GB, layer_ms=1.0, head_ms=240_666_624 / 24_127_488)
    assert balanced_split(qwen, by_bytes, 2) == even_split(qwen, 2)
    assert balanced_split(qwen, avx2, 3) == [11, 22]  # 11, 11 and 6 layers with the head: 127, 127, 128 ms
    heavy = ModelShape("heavy", 3, layer_bytes=1, embed_bytes=0, head_bytes=1000, kv_bytes_per_layer=1)
    assert balanced_split(heavy, DeviceProfile("pc", "CPU", GB, layer_ms=1.0, head_ms=1000.0), 3) == [1, 2]
    with pytest.raises(PlacementError, match="3 layers cannot be split into 4 parts"):
        balanced_split(heavy, avx2, 4)


# ---- the coordinator's name in saved profiles and plans ----

def test_a_profile_saved_before_this_pc_was_its_name_still_loads_and_pins(tmp_path):
    """Profiles (and the plans made from them) saved when the app called the coordinator "this
    machine" read as "this PC": the name the app and the CLI show, the one a plan is written with,
    and the one --pin matches (the former name too, for scripts)."""
    from engine.cli.fleet import _place
    from engine.fleet.deploy import LOCAL
    from engine.fleet.survey import current_names, load_survey, read_names

    f = fleet(dev("here", mem_gb=8), dev("b", mem_gb=8), coordinator="here")
    old = {"model": model(8).to_json(), "fleet": f.to_json(), "source": "m", "weights": "int4",
           "nodes": {"here": {"name": "this machine", "address": LOCAL},
                     "b": {"name": "alpha", "address": "127.0.0.1:9"}}}
    path = tmp_path / "fleet-profile.json"
    path.write_text(json.dumps(old))
    _, nodes, _ = load_survey(path)
    assert nodes == {"here": {"name": "this PC", "address": LOCAL}, "b": {"name": "alpha", "address": "127.0.0.1:9"}}
    assert read_names(old)["nodes"] == nodes and old["nodes"]["here"]["name"] == "this machine"  # not changed in place
    assert current_names(nodes) == nodes
    named = {"b": {"name": "this machine", "address": "127.0.0.1:9"}}  # a PC its owner named so keeps its name
    assert current_names(named) == named
    for pinned in ("this PC", "this machine"):
        doc, _ = _place(path, objective="latency", users=1, pins=[Pin(pinned, 0, 3), Pin("alpha", 3, 8)],
                        out=str(tmp_path / "plan.json"))
        assert [(s["node"], s["start"], s["end"]) for s in doc["plan"]["stages"]] == [("here", 0, 3), ("b", 3, 8)]
        assert json.loads((tmp_path / "plan.json").read_text())["nodes"]["here"]["name"] == "this PC"
