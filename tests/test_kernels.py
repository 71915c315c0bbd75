"""Our CPU kernels inside the graph (``engine.kernels``): the extension ``pip install`` builds loads here;
``GGMLMatMul`` multiplies by every carried GGUF type's blocks as the GGUF's values do, within the
rounding of its int8 activations, and gives a row of x the same numbers alone or in a batch (exact
mode relies on it); the blocks it runs are the GGUF's own again (``compose``); and a shard's carried
matrices swap in for it, while the stock path keeps the CPU plugin's MatMuls."""

from __future__ import annotations

import platform
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from engine import kernels
from engine.export.gguf_weights import BLOCKS, NAMES, Q4_K, Q6_K, carry_matmul, compose, decompose
from engine.kernels.swap import swap_in
from engine.runtime.stages.stage import core

ROWS = 77  # not a multiple of any thread's share
COLUMNS = 768  # three K-quant super-blocks
CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


def random_blocks(qtype: int, rng, rows: int = ROWS, columns: int = COLUMNS) -> np.ndarray:
    """Random blocks of a type with small finite f16 scales (any decoder must read them alike)."""
    size, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, columns // size, nbytes), dtype=np.uint8)
    at = {14: [(208, 210)], 12: [(0, 2), (2, 4)], 13: [(0, 2), (2, 4)], 3: [(0, 2), (2, 4)], 7: [(0, 2), (2, 4)]}
    for start, end in at.get(qtype, [(0, 2)]):
        raw[..., start:end] = rng.uniform(1e-3, 1e-2, (rows, columns // size, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def nodes():
    before = kernels.use(True)
    factory = kernels.factory(core())
    kernels.use(*before)
    return factory


def test_the_extension_is_built_by_the_install_and_loads_here(nodes):
    """On Linux x86-64 with a compiler (this machine, CI) the install builds the extension: a build that
    failed quietly (the extension is optional) fails here."""
    assert sys.platform.startswith("linux") and platform.machine() == "x86_64"
    assert kernels.library() is not None, kernels.unavailable()
    assert nodes is not None
    before = kernels.use(True)
    assert kernels.path(core())[0] == kernels.GGML
    kernels.use(False)
    assert kernels.path(core()) == (kernels.STOCK, "the stock path was chosen")
    kernels.use(*before)


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_compose_gives_back_the_gguf_blocks(qtype):
    raw = random_blocks(qtype, np.random.default_rng(qtype))
    assert np.array_equal(compose(decompose(qtype, raw, ROWS, COLUMNS)), raw)


def _compiled(nodes, qtype, raw, kernel):
    x = ops.parameter([-1, COLUMNS], np.float32)
    op = nodes.create(kernels.OP, [x.output(0), ops.constant(raw).output(0)],
                      {"ggml_type": qtype, "columns": COLUMNS, "kernel": kernel})
    return core().compile_model(ov.Model([op], [x]), "CPU", CONFIG)


@pytest.mark.parametrize("kernel", [kernels.OWN, kernels.GGML_KERNEL], ids=["ours", "ggml's"])
@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_the_operation_multiplies_by_the_gguf_values(nodes, qtype, kernel):
    rng = np.random.default_rng(200 + qtype)
    raw = random_blocks(qtype, rng)
    weights = decompose(qtype, raw, ROWS, COLUMNS).values()
    compiled = _compiled(nodes, qtype, raw, kernel)
    for batch in (1, 3, 9):  # 9: more rows than a kernel takes at once
        x = rng.standard_normal((batch, COLUMNS)).astype(np.float32)
        got, want = compiled(x)[0], x @ weights.T
        # int8 activations: within a few hundredths of the largest output
        assert got.shape == want.shape and np.abs(got - want).max() <= 0.03 * np.abs(want).max()
        alone = np.concatenate([compiled(x[i:i + 1])[0] for i in range(batch)])
        assert np.array_equal(got, alone)  # a row's numbers do not depend on its batch


def test_the_operation_refuses_a_shape_its_blocks_do_not_fit(nodes):
    raw = random_blocks(Q4_K, np.random.default_rng(0))
    x = ops.parameter([-1, 512], np.float32)
    with pytest.raises(RuntimeError, match="blocks are not"):
        nodes.create(kernels.OP, [x.output(0), ops.constant(raw).output(0)], {"ggml_type": Q4_K, "columns": 512})


@pytest.mark.parametrize("qtype, offsets", [(Q4_K, True), (Q6_K, False), (3, True), (8, False), (Q4_K, False)],
                         ids=["Q4_K offsets", "Q6_K", "Q4_1 offsets", "Q8_0", "Q4_K zero point"])
def test_a_carried_matrix_swaps_in_for_the_operation(nodes, qtype, offsets):
    """A matrix the exporter carried (``carry_matmul``) becomes one GGMLMatMul with its offsets folded
    in, and multiplies as the stock graph does; one with a float zero point keeps the stock MatMul."""
    rng = np.random.default_rng(qtype)
    raw = random_blocks(qtype, rng)
    q = decompose(qtype, raw, ROWS, COLUMNS)

    def graph():
        x = ops.parameter([1, -1, COLUMNS], ov.Type.f32, name="x")
        matmul = ops.matmul(x, ops.constant(np.zeros((ROWS, COLUMNS), np.float32)), False, True)
        matmul.set_friendly_name("layer/MatMul")
        model = ov.Model([ops.result(matmul)], [x])
        carry_matmul(matmul, q, offsets_from=0 if offsets else 10**9)
        return model

    stock, swapped = graph(), graph()
    counts = swap_in(swapped, nodes)
    kinds = [op.get_type_name() for op in swapped.get_ordered_ops()]
    exact = qtype in (Q6_K, 8)
    if offsets or exact:
        assert counts == {NAMES[qtype]: 1} and kinds.count("GGMLMatMul") == 1 and "MatMul" not in kinds
    else:
        assert counts == {} and "GGMLMatMul" not in kinds
    x = rng.standard_normal((1, 5, COLUMNS)).astype(np.float32)
    want = core().compile_model(stock, "CPU", CONFIG)(x)[0]
    got = core().compile_model(swapped, "CPU", CONFIG)(x)[0]
    assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()


def test_the_stock_path_keeps_a_shards_matmuls(nodes, tiny_exports):
    """Off (the default), reading a shard swaps nothing; a float shard has nothing to swap either way."""
    from engine.runtime.stages.stage import read_for

    folder = next(iter(tiny_exports.values())).folders[0]
    for wanted in (False, True):
        before = kernels.use(wanted)
        try:
            model, _ = read_for(folder, "CPU")
        finally:
            kernels.use(*before)
        assert not any(op.get_type_name() == "GGMLMatMul" for op in model.get_ops())
