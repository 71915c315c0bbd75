"""The calibration file: the constants tuned from measurements, each with where its value
came from.

Only this module cites measurement files (``bench-results/``) or the benchmarks page; the code that
uses a constant says what it does with it.  To retune one, measure again with the benchmark named
beside it and record the run on docs/benchmarks.md.  (The data-aware export's calibration text is
another thing: ``engine.export.calibration``.)
"""

from __future__ import annotations

# ---- placement and layouts (engine.fleet) ----

# What a token's exchanges cost tensor-parallel ranks (``placement.exchange_cost``) beyond the link
# (half a measured round trip an exchange, and the bytes at ``LINK_MBIT``): each exchange's own work
# in Python on the ranks (the graph's call into the collective, sealing, the socket's send and
# receive), EXCHANGE_FIXED_MS, and the faster rank's waits for the slower, a share EXCHANGE_WAIT of
# the slower rank's compute.  Fitted to `fleet bench sim --parts ranks` on three hosts and two kernel
# generations (a rank alone 38-199 ms a token): each run's decode time a token (the wave's time less
# its first token) of the ranks against that of one PC, beside the ratio the run's survey priced.
# Over the 16 rank rows this pair prices that ratio within 8.3% rms (the best pair, 0.22 and 0.20,
# 8.0%; the wait alone at 0.25 with no fixed cost 13%, and 28-33% in the ranks' favour in the run on
# the faster kernels where they lost to one PC, its fixed exchanges a larger share of a shorter
# token).  Of the pairs that fit about as well, the one with the larger fixed cost: the measured
# times alone say a rank token took about 37 ms plus 0.54 times one PC's on that host type over both
# kernel generations, a fixed 0.6 ms or so an exchange, and the profiles' compute is the noisier
# part (the eight ranks reports that docs/benchmarks.md, "What a rank exchange costs the solver", lists).
EXCHANGE_FIXED_MS = 0.30
EXCHANGE_WAIT = 0.15

# The link rate the cost model takes for the bytes of a rank exchange (``placement.exchange_cost``):
# the survey measures round trips, not rates; wired office Ethernet, the simulated office's link.
LINK_MBIT = 1000.0

# How much more a layout with a chain split over several nodes must predict than whole copies to be
# chosen (``layout.solve_layout``): the cost model prices a split's groups in flight as overlapping
# perfectly, and measured side by side copies served more than priced against the split
# (bench-results/2026-11-26/sim-office-qwen1.5b.json, bench-results/2026-11-27/
# sim-layout-qwen1.5b-fed.json; docs/benchmarks.md, "A second PC" and "The solver's layout").
CHAIN_MARGIN = 1.10

# How much more two PCs as tensor-parallel ranks must predict than the model whole on one PC to be
# chosen for one user (``layout.solve_layout``): any more at all, since measured side by side the
# ranks served more than one PC in every run, also where the cost model priced them below it
# (bench-results/2026-12-07/sim-ranks-qwen1.5b-zen3.json; docs/benchmarks.md, "One user on two PCs").
RANKS_MARGIN = 1.0

# What a stage takes in memory beyond its weights and KV cache: the OpenVINO runtime, Python and the
# compiled model's working memory (``profile.model_shape``).  A stage's memory that no file backs
# measured its weights plus about 100 MB; 200 MB leaves room for the file pages it keeps reading
# (bench-results/2026-11-26/sim-big-qwen1.5b.json; docs/benchmarks.md, "A model too big for one PC").
STAGE_OVERHEAD_BYTES = 200 << 20

# ---- export (engine.export) ----

# Float checkpoints below this many parameters export ``auto`` as int4-gptq, larger ones as int4
# (``compress.best_weights``): GPTQ gave SmolLM2-135M and Gemma 3 270M well under int4's KL for
# minutes of export, and Qwen2.5-Coder-1.5B a worse KL for 29 times the time
# (bench-results/2026-11-26/quality-calibrated-*.json; docs/benchmarks.md, "Data-aware INT4").
CALIBRATE_BELOW = 1_000_000_000

# From this many weights on, a carried GGUF matrix with a minimum gets its offsets from a second
# MatMul over the activations' group sums (``gguf_weights.carry_matmul``); a smaller one keeps a
# float zero point, where the extra ops cost more than they save: SmolLM2-135M's small matrices
# decoded faster with float zero points, Qwen2.5-Coder-1.5B's large ones faster with offsets
# (docs/benchmarks.md, "Faithful by default").
OFFSETS_FROM = 2**21

# The ratios a carried head's INT8 group ranges are shrunk by, the one that leaves the least squared
# error taken (``compress.vocab_table``): closer to the GGUF's table than the plain range, and than
# symmetric codes, on a real head (docs/benchmarks.md, "Parity with llama.cpp").
HEAD_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)

# ---- compiled stages (engine.runtime.stages) ----

# Entries the CPU plugin's per-model runtime cache and oneDNN's primitive cache keep (``stage``): a
# paged stage packing many streams sees a new input shape almost every round, and the defaults
# (5,000 and 1,024) grew the coordinator without bound; 64 each kept its memory flat at the same
# speed, where 0 cost 3 times the time (docs/benchmarks.md, "Soak" and "Smaller measurements behind
# the code's choices").
SHAPE_CACHE = 64

# The graphs with a fixed token axis a paged stage compiles besides its dynamic one
# (``engine.runtime.stages.paged``): for counts of rows up to FIXED_ROWS, each once FIXED_ROWS_AFTER
# forwards of its count ran on the dynamic graph (a count that recurs is a steady number of users, or
# of speculative rows), at most FIXED_GRAPHS with the one-row graph.  A fixed graph took 2.5-4 ms
# off a SmolLM2 round of 13-17 ms at 1, 2 and 4 rows, and costs its own working memory and the CPU
# plugin's copy of a matrix it repacks (an INT8 head): 55-75 MB a graph on SmolLM2, about 100 MB on
# Qwen2.5-Coder-1.5B (docs/benchmarks.md, "Fixed graphs for recurring row counts").
FIXED_ROWS = 8
FIXED_ROWS_AFTER = 8
FIXED_GRAPHS = 3
# A fixed graph is compiled only while this process may still take this much more memory (its
# machine's, within its cgroup's limits: ``engine.limits``), several times one graph's cost, so that a
# PC near its limit keeps the dynamic graph rather than be stopped for want of memory.
FIXED_HEADROOM_MB = 512

# Rows (tokens) a packed forward carries at most (``packing.packs_of``): a compiled model keeps the
# working memory of the largest forward it ran, and a failover's re-prefill of every reply at once
# left stage 0 tens of MB larger for good (docs/benchmarks.md, "Soak" and "Smaller measurements
# behind the code's choices").
PACK_ROWS = 256

# The band of MatMul depths (input columns) the CPU plugin's float path for compressed weights (a
# CPU without int8 dot products) runs at about half speed from a few rows up; ``rewrite`` splits
# such a MatMul into chunks of at most the lower bound (bench-results/2026-11-28/
# deep-matmul-depths-avx2.log; docs/benchmarks.md, "A rank's prefill at the CPU's full speed").
SLOW_DEPTH = (4096, 8192)

# ---- speculative decoding (engine.runtime.decode) ----

# What one more verify position adds to a speculative round, as a share of the round
# (``speculative.DraftModel``: a draft that would bring less than that is not made); a position
# costs a few ms of a round of about 100 on Qwen2.5-Coder-1.5B (docs/speculative-history.md, the
# verify's cost by width, and "Draft steps at a steady width").
DRAFT_POSITION_SHARE = 0.04

# The cap on a draft model's confidence scale (accepted drafts per unit of its top-1 probability,
# which sets how far it drafts under K auto): the 0.5B draft is under-confident in ``fast`` mode, and
# capped at 1 it stopped drafting where its drafts were still being accepted; 1.5 served better than
# 1 side by side in both modes (docs/benchmarks.md, "Speculative decoding"; docs/speculative-history.md,
# which has a cap of 2 in ``exact`` too).
DRAFT_MAX_TRUST = 1.5

# What the hybrid drafter takes a prompt-lookup draft position's record to be, [right, tried], before
# that position was ever scored (``speculative.Hybrid``): the first draft after a match right half the
# time, a draft after right drafts three times in four.  The lookup's drafts measured about that in
# prose and in reasoning text (docs/benchmarks.md, "Smaller measurements behind the code's choices").
LOOKUP_PRIOR = ((1.0, 2.0), (1.5, 2.0))
