"""The layout solver: one chain over the fleet or copies of the model (replicas), chosen for the
expected users from the same cost model as the placement; and `fleet place` writing the copies
into the plan document that `fleet deploy` reads."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from engine.fleet.layout import Layout, price_layout, shares, solve_layout
from engine.fleet.placement import GB, DeviceProfile, Fleet, ModelShape, evaluate, solve
from engine.fleet.plans import layout_stages
from engine.tuning import CHAIN_MARGIN, EXCHANGE_FIXED_MS, EXCHANGE_WAIT, LINK_MBIT

# Qwen 1.5B-like: 28 layers, an INT8 head as heavy as ten layers
MODEL = ModelShape("qwen", 28, 30_000_000, 100_000_000, 250_000_000, 2_000_000, 200_000_000)


def office(n: int, memory_gb: float, *, layer_ms: float = 2.2) -> Fleet:
    devices = [DeviceProfile(f"pc{i}", "CPU", int(memory_gb * GB), layer_ms, 12.0, 0.1, prefill_layer_ms=0.3,
                             call_ms=1.0) for i in range(1, n + 1)]
    rtt = {(f"pc{i}", f"pc{j}"): 0.3 for i in range(1, n + 1) for j in range(i + 1, n + 1)}
    return Fleet(devices, rtt, coordinator="pc1")


def chains(layout: Layout) -> list[list[tuple[str, int, int]]]:
    return [[(s.node, s.start, s.end) for s in plan.stages] for plan in layout.plans]


def test_one_user_gets_one_chain_and_many_users_get_a_copy_per_pc():
    fleet = office(2, 4)
    assert chains(solve_layout(MODEL, fleet, users=1)) == [[("pc1", 0, 28)]]
    for users in (2, 4, 8):
        layout = solve_layout(MODEL, fleet, users=users)
        # the model whole here, and whole on pc2, fed from here
        assert chains(layout) == [[("pc1", 0, 28)], [("pc2", 0, 28)]], users
        assert [p.users for p in layout.plans] == shares(users, 2)
        assert layout.aggregate_tok_s > solve(MODEL, fleet, objective="latency").aggregate_tok_s * 1.5
    one = solve_layout(MODEL, fleet, users=4, replicas=False)
    assert len(one.plans) == 1 and len(one.plans[0].stages) == 2  # asked for one chain: the split


def test_pcs_that_cannot_hold_the_model_share_one_chain():
    layout = solve_layout(MODEL, office(3, 0.8), users=4)
    assert len(layout.plans) == 1 and len(layout.plans[0].stages) == 3


def test_three_pcs_mix_copies_and_a_split_and_copies_go_only_where_the_model_fits():
    two_copies = solve_layout(MODEL, office(3, 4), users=2)
    # two users, three PCs: two copies, each whole on its PC (the one here needs no hop)
    assert len(two_copies.plans) == 2 and all(len(p.stages) == 1 for p in two_copies.plans)
    assert two_copies.plans[0].stages[0].node == "pc1"
    both = solve_layout(MODEL, office(3, 4), users=9)
    assert len(both.plans) == 3 and sum(p.users for p in both.plans) == 9
    assert sorted(p.stages[0].node for p in both.plans) == ["pc1", "pc2", "pc3"]  # every PC serves a copy
    # a node that cannot hold the model whole serves no copy of its own: it joins this PC's chain
    small = Fleet([*(d if d.node != "pc2" else DeviceProfile("pc2", "CPU", int(0.6 * GB), 2.2, 12.0, 0.1,
                                                              prefill_layer_ms=0.3, call_ms=1.0)
                     for d in office(2, 4).devices)], office(2, 4).rtt_ms, coordinator="pc1")
    assert not evaluate(MODEL, small, [("pc2", "CPU", 0, 28)], fed=True).ok
    assert len(solve_layout(MODEL, small, users=4).plans) == 1


def test_copies_fed_from_here_cost_it_nothing_and_a_much_faster_chain_still_wins():
    fleet = office(2, 4)
    copies = solve_layout(MODEL, fleet, users=4).plans
    fed = copies[1]
    assert fed.network_ms == pytest.approx(fleet.rtt("pc1", "pc2"))  # the hop there and back
    assert fed.aggregate_tok_s < copies[0].aggregate_tok_s
    layout = price_layout(MODEL, fleet, copies, 4)
    assert layout.coordinator_load <= 1.0  # only its own copy computes here
    assert layout.aggregate_tok_s == pytest.approx(sum(p.aggregate_tok_s for p in copies))
    # a copy's first layer kept here would be priced as this PC's time too: both copies slow down
    split = evaluate(MODEL, fleet, [("pc1", "CPU", 0, 1), ("pc2", "CPU", 1, 28)], users=2).plan
    assert price_layout(MODEL, fleet, [copies[0], split], 4).coordinator_load > 1.0
    # PCs with fast GPUs that cannot hold the model alone, and a slow CPU here: the chain over the
    # GPUs is far faster than any copy could be
    gpus = [DeviceProfile(f"pc{i}", "GPU.0", int(0.9 * GB), 0.3, 2.0, 0.05, prefill_layer_ms=0.05)
            for i in (2, 3)]
    mixed = Fleet([*office(3, 4, layer_ms=6.0).devices, *gpus], office(3, 4).rtt_ms, coordinator="pc1")
    chosen = solve_layout(MODEL, mixed, users=4)
    single = solve(MODEL, mixed, objective="throughput", users=4)
    if len(chosen.plans) > 1:
        assert chosen.aggregate_tok_s * CHAIN_MARGIN >= single.aggregate_tok_s
    else:
        assert chains(chosen) == [[(s.node, s.start, s.end) for s in single.stages]]


def test_layouts_round_trip_and_explain_each_copy():
    layout = solve_layout(MODEL, office(2, 4), users=4)
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    text = layout.explain()
    assert text.startswith("2 copies of the model, 4 user(s) spread over them") and "copy 2:" in text


def test_fleet_place_writes_the_copies_that_deploy_reads(tmp_path):
    fleet = office(2, 4)
    profile = {"model": MODEL.to_json(), "fleet": fleet.to_json(),
               "nodes": {"pc1": {"name": "this PC", "address": "local"},
                         "pc2": {"name": "beta", "address": "10.0.0.2:7420"}}}
    (tmp_path / "profile.json").write_text(json.dumps(profile))

    def place(*extra: str) -> dict:
        out = tmp_path / "plan.json"
        run = subprocess.run([sys.executable, "-m", "engine.cli", "place", "--profile", str(tmp_path / "profile.json"),
                              "--objective", "throughput", "--users", "4", "--out", str(out), *extra],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        return json.loads(out.read_text()) | {"stdout": run.stdout}

    doc = place()
    assert "2 copies of the model, 4 user(s)" in doc["stdout"] and "beta" in doc["stdout"]
    copies = layout_stages(doc)
    assert [[(s.node, s.start, s.end) for s in c] for c in copies] == [[("local", 0, 28)], [("10.0.0.2:7420", 0, 28)]]
    one = place("--one-chain")
    assert one["replicas"] == [] and len(layout_stages(one)) == 1 and len(layout_stages(one)[0]) == 2


def test_a_copys_failover_rewrites_only_that_copy_in_the_saved_record(tmp_path):
    from engine.fleet.deploy import Deployment, LiveRecord

    def copy(name, worker):
        return Deployment(model="m", stage0=f"{name}/stage0", device="CPU", remotes=[f"{name}:2"],
                          workers=[{"agent": f"{name}:1", "worker": worker, "stage": 1}])

    whole = copy("a", "w1")
    whole.replicas = [copy("b", "w2").to_json(), copy("c", "w3").to_json()]
    whole.draft = {"agent": "d:1", "worker": "w4", "address": "d:2", "model": "draft"}
    path = whole.save(tmp_path / "deployment.json")
    live = LiveRecord(whole, path)
    moved = copy("e", "w5")  # copy 1 (on b) moved to e by its failover: a new deployment, a new id
    live.replace(1, moved)
    saved = Deployment.load(path)
    assert [c.workers[0]["worker"] for c in saved.copies] == ["w1", "w5", "w3"]
    assert saved.id == whole.id and saved.draft == whole.draft
    assert whole.current(path).copies[1].remotes == ["e:2"]  # what a stop now reaches
    assert copy("x", "w9").current(path).workers[0]["worker"] == "w9"  # another deployment's record is not ours


def test_whole_copies_win_unless_a_split_predicts_the_margin_more():
    """PC 2 a little slower: the cost model prices a split over here and PC 2, beside a copy on PC 3,
    just above three whole copies; measured, splits serve less than priced, so the copies are chosen."""
    from engine.fleet.layout import _own_copy, _without

    base = office(3, 4)
    fleet = Fleet([dataclasses.replace(d, layer_ms=3.5) if d.node == "pc2" else d for d in base.devices], base.rtt_ms,
                  coordinator="pc1")
    chain = solve(MODEL, _without(fleet, {"pc3"}), objective="throughput", users=3)
    mixed = price_layout(MODEL, fleet, [chain, _own_copy(MODEL, fleet, "pc3", 3)], 6)
    chosen = solve_layout(MODEL, fleet, users=6)
    assert len(chain.stages) == 2 and mixed.aggregate_tok_s > chosen.aggregate_tok_s  # priced above the copies
    assert chosen.aggregate_tok_s * CHAIN_MARGIN > mixed.aggregate_tok_s
    assert chains(chosen) == [[("pc1", 0, 28)], [("pc2", 0, 28)], [("pc3", 0, 28)]]


def test_one_user_on_slow_pcs_gets_two_tensor_parallel_ranks_and_more_users_get_copies():
    """Where a layer costs much more than the exchanges its ranks add (a CPU without int8 dot
    products), one user is served fastest by two PCs as ranks; never where the model's export
    cannot be split, where the link is slow, or once users can be spread over copies."""
    from engine.fleet.placement import exchanges, price_ranks

    splittable = dataclasses.replace(MODEL, max_ranks=2)
    slow = office(2, 4, layer_ms=15.0)
    layout = solve_layout(splittable, slow, users=1)
    plan, = layout.plans
    assert plan.ranks and chains(layout) == [[("pc1", 0, 28), ("pc2", 0, 28)]]
    whole = evaluate(splittable, slow, [("pc1", "CPU", 0, 28)]).plan
    assert plan.tok_s > whole.tok_s * CHAIN_MARGIN
    # a round trip for the ids, and at each exchange half a round trip and its own work, and the waits
    assert plan.network_ms == pytest.approx(0.3 + exchanges(28) * (0.15 + EXCHANGE_FIXED_MS)
                                            + plan.stages[1].ms * EXCHANGE_WAIT)
    assert plan.stages[0].memory_bytes < whole.stages[0].memory_bytes  # each holds half the layers and head
    assert "2 PCs as tensor-parallel ranks" in layout.explain() and "57 exchanges" in layout.explain()
    stages = layout_stages({"plan": plan.to_json(), "nodes": {"pc1": {"address": "local"},
                                                                "pc2": {"address": "10.0.0.2:7000"}}})
    assert [(s.node, s.start, s.end, s.rank) for s in stages[0]] == [("local", 0, 28, 0), ("10.0.0.2:7000", 0, 28, 1)]
    assert type(plan).from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert not any(p.ranks for p in solve_layout(splittable, slow, users=2).plans)  # two copies serve 2 users
    assert not solve_layout(MODEL, slow, users=1).plans[0].ranks  # its export is not split
    far = Fleet(slow.devices, {k: 10.0 for k in slow.rtt_ms}, coordinator="pc1")
    assert not solve_layout(splittable, far, users=1).plans[0].ranks  # 57 exchanges over a slow link
    fast = office(2, 4, layer_ms=0.3)
    assert not solve_layout(splittable, fast, users=1).plans[0].ranks  # fast layers: the exchanges cost more
    small = price_ranks(splittable, office(2, 0.5, layer_ms=15.0), [("pc1", "CPU"), ("pc2", "CPU")])
    assert any("needs" in p for p in small.problems)


def test_the_fastest_plan_for_one_user_may_be_two_ranks():
    from engine.fleet.layout import fastest_for_one
    from engine.fleet.placement import price_ranks

    splittable = dataclasses.replace(MODEL, max_ranks=2)
    slow, fast = office(2, 4, layer_ms=15.0), office(2, 4, layer_ms=0.3)
    chain = solve(splittable, slow, objective="latency")
    assert (fastest_for_one(splittable, slow, chain).ranks
            and fastest_for_one(splittable, slow, chain).objective == "latency")
    assert fastest_for_one(splittable, fast, solve(splittable, fast, objective="latency")).ranks is False
    assert fastest_for_one(MODEL, slow, chain) == chain
    # ranks that predict a little more than the model whole (less than a chain's margin) are chosen,
    # ranks that predict a little less are not
    for layer_ms, chosen in ((1.9, True), (1.7, False)):
        fleet = office(2, 4, layer_ms=layer_ms)
        whole = evaluate(splittable, fleet, [("pc1", "CPU", 0, 28)]).plan.tok_s
        ranks = price_ranks(splittable, fleet, [("pc1", "CPU"), ("pc2", "CPU")]).plan.tok_s
        assert (whole < ranks < whole * CHAIN_MARGIN) if chosen else ranks < whole
        assert fastest_for_one(splittable, fleet, solve(splittable, fleet, objective="latency")).ranks is chosen
        assert solve_layout(splittable, fleet, users=1).plans[0].ranks is chosen


# Qwen2.5-Coder-1.5B's shape where it matters here: 28 layers, a 1536-wide hidden state exchanged in f32
QWEN = dataclasses.replace(MODEL, max_ranks=2, exchange_bytes=1536 * 4)


def sim_office(layer_ms: float, head_ms: float, rtt_ms: float) -> Fleet:
    """Two PCs of one core each as `fleet bench sim --parts ranks` profiled them with the kernels of
    2026-12: the model whole in 72.7 ms a token here, PC 2 a little slower, a round trip of 0.3-0.45 ms."""
    devices = [DeviceProfile(node, "CPU", 8 * GB, layer_ms * slower, head_ms * slower, prefill_layer_ms=0.3,
                             call_ms=0.12) for node, slower in (("pc1", 1.0), ("pc2", 1.1))]
    return Fleet(devices, {("pc1", "pc2"): rtt_ms}, coordinator="pc1")


def test_one_user_on_the_simulated_office_gets_one_pc_not_two_ranks():
    """The simulated office's PCs (one core each, 1 Gbit/s): the ranks' 57 exchanges a token cost
    more than the half of the compute they save, so one user is served by one PC, as measured there;
    ranks are chosen only where their predicted gain is larger than the exchanges' modelled cost."""
    from engine.fleet.layout import fastest_for_one
    from engine.fleet.placement import exchange_cost, exchanges, price_ranks

    for rtt_ms in (0.3, 0.45):
        fleet = sim_office(2.34, 7.0, rtt_ms)
        whole = evaluate(QWEN, fleet, [("pc1", "CPU", 0, 28)]).plan
        assert whole.token_ms == pytest.approx(72.7, abs=0.1)
        ranks = price_ranks(QWEN, fleet, [("pc1", "CPU"), ("pc2", "CPU")]).plan
        saved = whole.token_ms - max(s.ms for s in ranks.stages)  # the compute the second rank takes over
        cost = exchange_cost(QWEN, 2, rtt_ms, max(s.ms for s in ranks.stages))
        assert ranks.network_ms == pytest.approx(cost) and cost > saved and ranks.tok_s < whole.tok_s
        # each exchange: half the round trip, its own work, and 6 kB at 1 Gbit/s (49 µs)
        assert cost > exchanges(28) * (rtt_ms / 2 + EXCHANGE_FIXED_MS) + 56 * 6144 / (LINK_MBIT * 125)
        chain = solve(QWEN, fleet, objective="latency")
        assert not fastest_for_one(QWEN, fleet, chain).ranks
        assert not solve_layout(QWEN, fleet, users=1).plans[0].ranks


def test_ranks_still_win_where_compute_dominates():
    """Slower PCs (a CPU without int8 dot products: 4x the compute a token) on a fast link: the half
    of the compute saved outweighs the exchanges, and one user gets two ranks."""
    from engine.fleet.layout import fastest_for_one
    from engine.fleet.placement import price_ranks

    fleet = sim_office(4 * 2.34, 4 * 7.0, 0.2)
    whole = evaluate(QWEN, fleet, [("pc1", "CPU", 0, 28)]).plan
    ranks = price_ranks(QWEN, fleet, [("pc1", "CPU"), ("pc2", "CPU")]).plan
    assert ranks.tok_s > whole.tok_s * 1.2
    assert fastest_for_one(QWEN, fleet, solve(QWEN, fleet, objective="latency")).ranks
    assert solve_layout(QWEN, fleet, users=1).plans[0].ranks
