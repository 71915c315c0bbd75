"""Where a tensor-parallel rank's share of each layer matrix is cut (``fleet export --ranks``).

A rank holds some key/value heads and the query heads that read them, and some of the MLP's
columns: the rows of ``q``/``k``/``v``/``gate``/``up`` that compute them, and the same columns of the
output projections ``o`` and ``down``, whose products are then partial sums (added across the ranks
by ``engine.transport.mesh.AllReduce``).  The MLP is cut in whole units, so each rank's quantized
groups are the whole model's: 128 columns for INT4's groups, 256 for a GGUF's super-blocks, whose
``o`` and ``down`` rows are then cut between blocks (``GGUF_UNIT``).  Torch-free: the fleet's
placement asks ``ranks_problem`` on machines that only serve shards.
"""

from __future__ import annotations

MLP_UNIT = 128  # INT4's group: each rank's codes are the whole model's
GGUF_UNIT = 256  # a K-quant super-block (a multiple of the legacy types' 32)


def share(count: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rank ``rank``'s part ``[lo, hi)`` of ``count`` items split as evenly as they go."""
    return count * rank // ranks, count * (rank + 1) // ranks


def rank_cuts(spec, rank: int, ranks: int, unit: int = MLP_UNIT) -> tuple[dict[str, tuple[int, slice]], int, int]:
    """For each matrix and bias a rank cuts, the axis (0: rows, 1: columns) and the slice it keeps;
    with the rank's query and key/value head counts."""
    groups = spec.num_heads // spec.num_kv_heads
    kv_lo, kv_hi = share(spec.num_kv_heads, rank, ranks)
    d = spec.head_dim
    q_rows = slice(kv_lo * groups * d, kv_hi * groups * d)
    kv_rows = slice(kv_lo * d, kv_hi * d)
    unit = unit if spec.intermediate_size % unit == 0 and spec.intermediate_size // unit >= ranks else 1
    lo, hi = share(spec.intermediate_size // unit, rank, ranks)
    mlp = slice(lo * unit, hi * unit)
    cuts = {"q": (0, q_rows), "q_bias": (0, q_rows), "k": (0, kv_rows), "k_bias": (0, kv_rows), "v": (0, kv_rows),
            "v_bias": (0, kv_rows), "gate": (0, mlp), "up": (0, mlp), "o": (1, q_rows), "down": (1, mlp)}
    return cuts, (kv_hi - kv_lo) * groups, kv_hi - kv_lo


def ranks_problem(spec, ranks: int, weights: str) -> str | None:
    """Why a model of ``spec`` in ``weights`` cannot be exported as ``ranks`` tensor-parallel ranks,
    or None."""
    if spec.num_kv_heads < ranks:
        return (f"the model has {spec.num_kv_heads} key/value heads: it cannot be split into {ranks} "
                f"tensor-parallel ranks")
    if spec.vocab_size % ranks:
        return f"the vocabulary ({spec.vocab_size} tokens) does not split evenly into {ranks} ranks"
    if weights == "gguf":
        cuts = [rank_cuts(spec, r, ranks, GGUF_UNIT)[0] for r in range(ranks)]
        if any(cut[part][1].start % GGUF_UNIT for cut in cuts for part in ("o", "down")):
            return (f"the gguf weight format splits rows between {GGUF_UNIT}-value blocks: this model's heads "
                    f"or MLP ({spec.intermediate_size} columns) do not split into {ranks} ranks there")
    return None
