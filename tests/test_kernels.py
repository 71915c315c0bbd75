"""Our CPU kernels inside the graph (``engine.kernels``): the extension ``pip install`` builds loads here;
``GGMLMatMul`` multiplies by every carried GGUF type as the GGUF's values do, within the rounding of
its int8 activations, with our kernels from a matrix's tiles and with ggml's from its blocks, and within
float rounding with our kernels' activations in float (exact mode); it gives a row of x the same numbers
alone or in a batch (exact mode relies on it); the blocks ggml's kernels
run are the GGUF's own again (``compose``); and a shard's carried matrices swap in for it, while the
stock path keeps the CPU plugin's MatMuls."""

from __future__ import annotations

import platform
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from engine import kernels
from engine.bench import kernels as kernel_bench
from engine.export.gguf_weights import carry_matmul
from engine.kernels.swap import swap_in
from engine.kernels.tiles import TYPES, tiles
from engine.models.quantized import BLOCKS, NAMES, Q4_K, Q6_K, compose, decompose
from engine.runtime.stages.stage import core

ROWS = 77  # not a multiple of any thread's share
COLUMNS = 768  # three K-quant super-blocks
CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}


def random_blocks(qtype: int, rng, rows: int = ROWS, columns: int = COLUMNS) -> np.ndarray:
    """Random blocks of a type (the kernel microbench's), ROWS by COLUMNS unless said."""
    return kernel_bench.random_blocks(qtype, rng, rows, columns)


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
    assert kernels.tile_width() in (8, 16, 0)
    kernels.use(False)
    assert kernels.path(core()) == (kernels.STOCK, "the stock path was chosen")
    kernels.use(*before)


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_compose_gives_back_the_gguf_blocks(qtype):
    raw = random_blocks(qtype, np.random.default_rng(qtype))
    assert np.array_equal(compose(decompose(qtype, raw, ROWS, COLUMNS)), raw)


def _compiled(nodes, qtype, raw, kernel, float_x=False):
    x = ops.parameter([-1, COLUMNS], np.float32)
    matrix = raw if kernel == kernels.GGML_KERNEL else tiles(decompose(qtype, raw, ROWS, COLUMNS))
    op = nodes.create(kernels.OP, [x.output(0), ops.constant(matrix).output(0)],
                      {"ggml_type": qtype, "rows": ROWS, "columns": COLUMNS, "kernel": kernel,
                       "float_x": int(float_x)})
    return core().compile_model(ov.Model([op], [x]), "CPU", CONFIG)


KERNELS = {kernels.OWN: "ours", kernels.OWN_256: "ours with AVX-VNNI", kernels.OWN_AVX2: "ours with AVX2",
           kernels.GGML_KERNEL: "ggml"}
OURS = (kernels.OWN, kernels.OWN_256, kernels.OWN_AVX2)
CASES = [(qtype, kernel, float_x) for float_x in (False, True) for kernel in OURS for qtype in TYPES] + \
        [(qtype, kernels.GGML_KERNEL, False) for qtype in sorted(BLOCKS)]


@pytest.mark.parametrize("qtype, kernel, float_x", CASES,
                         ids=[f"{NAMES[t]} {KERNELS[k]}{', x in float' if f else ''}" for t, k, f in CASES])
def test_the_operation_multiplies_by_the_gguf_values(nodes, qtype, kernel, float_x):
    """Our kernels in each instruction set this CPU has, with x in int8 and in float, and ggml's, on 77
    rows: a last tile of padding."""
    if kernel != kernels.GGML_KERNEL and not kernels.tile_width():
        pytest.skip("this CPU has no AVX2: our kernels do not run here")
    rng = np.random.default_rng(200 + qtype)
    raw = random_blocks(qtype, rng)
    weights = decompose(qtype, raw, ROWS, COLUMNS).values().astype(np.float64)
    try:
        compiled = _compiled(nodes, qtype, raw, kernel, float_x)
    except RuntimeError as exc:
        if kernel == kernels.OWN_256 and "no kernel of ours" in str(exc):
            pytest.skip("this CPU has no AVX-VNNI: those kernels do not run here")
        raise
    # int8 activations: within a few hundredths of the largest output; float ones: float32's rounding
    tolerance = 1e-5 if float_x else 0.03
    for batch in (1, 3, 5, 9):  # 9: more rows than a kernel takes at once
        x = rng.standard_normal((batch, COLUMNS)).astype(np.float32)
        got, want = compiled(x)[0], x @ weights.T
        assert got.shape == want.shape and np.abs(got - want).max() <= tolerance * np.abs(want).max()
        alone = np.concatenate([compiled(x[i:i + 1])[0] for i in range(batch)])
        assert np.array_equal(got, alone)  # a row's numbers do not depend on its batch


ROW_CASES = [(qtype, kernel, float_x) for float_x in (False, True) for kernel in (kernels.OWN, kernels.OWN_AVX2)
             for qtype in TYPES]


@pytest.mark.parametrize("qtype, kernel, float_x", ROW_CASES,
                         ids=[f"{NAMES[t]} {KERNELS[k]}{', x in float' if f else ''}" for t, k, f in ROW_CASES])
def test_every_count_of_rows_at_once_gives_a_row_the_same_numbers(nodes, qtype, kernel, float_x):
    """Each batch of 1 to 8 rows of x (a kernel takes up to 8 at once, and each count is a kernel of
    its own) gives each row the very numbers it gets alone."""
    if not kernels.tile_width():
        pytest.skip("this CPU has no AVX2: our kernels do not run here")
    rng = np.random.default_rng(300 + qtype)
    compiled = _compiled(nodes, qtype, random_blocks(qtype, rng), kernel, float_x)
    x = rng.standard_normal((8, COLUMNS)).astype(np.float32)
    alone = np.concatenate([compiled(x[i:i + 1])[0] for i in range(8)])
    for batch in range(2, 9):
        assert np.array_equal(compiled(x[:batch])[0], alone[:batch]), f"{batch} rows at once"


def test_float_activations_run_our_kernels_only(nodes):
    """ggml's kernels take x in the type's int8 partner: x in float is refused for them."""
    raw = random_blocks(Q4_K, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="x in float runs our kernels only"):
        _compiled(nodes, Q4_K, raw, kernels.GGML_KERNEL, float_x=True)


@pytest.mark.parametrize("kernel", [kernels.OWN, kernels.GGML_KERNEL], ids=["tiles", "blocks"])
def test_the_operation_refuses_a_shape_its_blocks_do_not_fit(nodes, kernel):
    if kernel == kernels.OWN and not kernels.tile_width():
        pytest.skip("this CPU has no AVX2: our kernels do not run here")
    raw = random_blocks(Q4_K, np.random.default_rng(0))
    matrix = raw if kernel == kernels.GGML_KERNEL else tiles(decompose(Q4_K, raw, ROWS, COLUMNS))
    x = ops.parameter([-1, 512], np.float32)
    with pytest.raises(RuntimeError, match="blocks are not"):
        nodes.create(kernels.OP, [x.output(0), ops.constant(matrix).output(0)],
                     {"ggml_type": Q4_K, "rows": ROWS, "columns": 512, "kernel": kernel})


def test_tiles_refuse_a_type_our_kernels_do_not_run():
    with pytest.raises(ValueError, match="no tiles"):
        tiles(decompose(8, random_blocks(8, np.random.default_rng(0)), ROWS, COLUMNS))


EXACT = {**CONFIG, "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}  # the stock path's float activations
OURS_NAMES = {NAMES[t] for t in TYPES}
SWAPS = [(Q4_K, True, "Q4_K"), (Q6_K, False, "Q6_K"), (3, True, "Q4_1"), (8, False, "Q8_0"), (2, False, "Q4_0"),
         (Q4_K, False, "Q4_1"), (3, False, "Q4_1"), (7, False, None)]


@pytest.mark.parametrize("qtype, offsets, runs_as", SWAPS,
                         ids=["Q4_K offsets", "Q6_K", "Q4_1 offsets", "Q8_0", "Q4_0", "Q4_K zero point",
                              "Q4_1 zero point", "Q5_1 zero point"])
def test_a_carried_matrix_swaps_in_for_the_operation(nodes, qtype, offsets, runs_as):
    """A matrix the exporter carried (``carry_matmul``) becomes one GGMLMatMul with its offsets folded
    in, and multiplies as the stock graph does; a 4-bit one with a float zero point runs as Q4_1, a
    wider one keeps the stock MatMul."""
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

    stock = graph()
    x = rng.standard_normal((1, 5, COLUMNS)).astype(np.float32)
    want = core().compile_model(stock, "CPU", EXACT)(x)[0]
    for float_x in (False, True):
        swapped = graph()
        counts = swap_in(swapped, nodes, float_x=float_x)
        kinds = [op.get_type_name() for op in swapped.get_ordered_ops()]
        if runs_as and (not float_x or runs_as in OURS_NAMES):  # x in float: our kernels' types only
            assert counts == {runs_as: 1} and kinds.count("GGMLMatMul") == 1 and "MatMul" not in kinds
        else:
            assert counts == {} and "GGMLMatMul" not in kinds
        got = core().compile_model(swapped, "CPU", EXACT if float_x else CONFIG)(x)[0]
        # x in float: within f16's rounding of a zero point's minimum (Q4_1 stores m in f16)
        assert np.abs(got - want).max() <= (2e-3 if float_x else 0.03) * np.abs(want).max()


def test_the_stock_path_keeps_a_shards_matmuls(nodes, tiny_exports):
    """A float shard has nothing to swap, with the operation chosen (the default) or not."""
    from engine.runtime.stages.stage import read_for

    folder = next(iter(tiny_exports.values())).folders[0]
    for wanted in (False, True):
        before = kernels.use(wanted)
        try:
            model, _ = read_for(folder, "CPU")
        finally:
            kernels.use(*before)
        assert not any(op.get_type_name() == "GGMLMatMul" for op in model.get_ops())


def test_on_the_stock_path_a_carried_head_runs_as_int8_rows():
    """A head carried with its Q6_K codes becomes INT8 rows for the CPU plugin's own MatMul: the same
    logits within INT8's rounding; a head without the tag is left as it is."""
    from engine.kernels.swap import int8_head

    rng = np.random.default_rng(3)
    raw = random_blocks(Q6_K, rng)
    q = decompose(Q6_K, raw, ROWS, COLUMNS)

    def graph(carried=True):
        x = ops.parameter([1, -1, COLUMNS], ov.Type.f32, name="x")
        head = ops.matmul(x, ops.constant(q.values()), False, True)
        model = ov.Model([ops.result(head)], [x])
        if carried:
            carry_matmul(head, q)
        return model

    model = graph()
    assert int8_head(model)
    weight = [op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
              and op.get_element_type() == ov.Type.u8]
    assert weight and not int8_head(graph(carried=False))
    x = rng.standard_normal((1, 4, COLUMNS)).astype(np.float32)
    got = core().compile_model(model, "CPU", CONFIG)(x)[0]
    want = x @ q.values().T
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_siblings_in_whole_tiles_share_one_operation_with_the_same_numbers(nodes):
    """Three carried matrices on one input: the two of whole tiles (64 and 32 rows) become one
    GGMLMatMul split back, the one of 77 rows (a padded tile) keeps its own; each output is the
    one it had alone, bit for bit."""
    if not kernels.tile_width():
        pytest.skip("this CPU has no AVX2: our kernels do not run here")
    rng = np.random.default_rng(5)
    quantized = [decompose(Q6_K, random_blocks(Q6_K, rng, rows), rows, COLUMNS) for rows in (64, 32, ROWS)]

    def graph():
        x = ops.parameter([1, -1, COLUMNS], ov.Type.f32, name="x")
        results = []
        for i, q in enumerate(quantized):
            matmul = ops.matmul(x, ops.constant(np.zeros((len(q.codes), COLUMNS), np.float32)), False, True)
            matmul.set_friendly_name(f"layer/{i}/MatMul")
            results.append(ops.result(matmul))
            carry_matmul(matmul, q, offsets_from=10**9)
        return ov.Model(results, [x])

    fused = graph()
    assert swap_in(fused, nodes) == {"Q6_K": 3}
    kinds = [op.get_type_name() for op in fused.get_ordered_ops()]
    assert kinds.count("GGMLMatMul") == 2 and kinds.count("VariadicSplit") == 1
    x = rng.standard_normal((1, 5, COLUMNS)).astype(np.float32)
    got = core().compile_model(fused, "CPU", CONFIG)(x)
    for i, q in enumerate(quantized):  # each matrix alone in a graph of its own
        x_alone = ops.parameter([1, -1, COLUMNS], ov.Type.f32, name="x")
        matmul = ops.matmul(x_alone, ops.constant(np.zeros((len(q.codes), COLUMNS), np.float32)), False, True)
        carry_matmul(matmul, q, offsets_from=10**9)
        single = ov.Model([ops.result(matmul)], [x_alone])
        assert swap_in(single, nodes) == {"Q6_K": 1}
        assert np.array_equal(got[i], core().compile_model(single, "CPU", CONFIG)(x)[0])
