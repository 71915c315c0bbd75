"""A model split into tensor-parallel ranks: rank 0 in this process, the others on workers.

Each call of the generation loop (a forward, a reset, a rewind) goes first to every worker, then
runs here; the ranks' collectives (``engine.transport.mesh``) make the forwards meet layer by
layer, so every PC computes its share of the same token at the same time.  Rank 0's logits are the
whole model's; the workers' results only confirm that their forward completed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.config import FleetAccess, ShardOptions
from engine.errors import ShardError, StageError
from engine.manifest import Manifest, load_manifest
from engine.runtime.interfaces import Chain
from engine.runtime.relay.remote import RemoteChain
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.output import Output
from engine.runtime.stages.stage import compile_config
from engine.transport.link import parse_address
from engine.transport.mesh import Mesh, MeshError
from engine.transport.wire import Flag


class RankChain(Chain):
    """A chain of one model's tensor-parallel ranks: rank 0 here, each other rank on a worker."""

    paged = False
    packs = False  # every rank must run the same forwards: one round at a time

    def __init__(self, rank0: Path | str, workers: list[str], *, access: FleetAccess,
                 shard: ShardOptions = ShardOptions(), connect_timeout_s: float = 60.0,
                 manifest: Manifest | None = None):
        """``rank0``: rank 0's shard folder (``manifest``: its manifest, when already loaded);
        ``workers``: rank 1's worker address, then rank 2's...  Each worker names its mesh port in
        its PONG; rank 0 dials it there.  ``shard``: how rank 0 is compiled (its device, the
        correctness mode every rank must run, the precision hint; its weights go unused here)."""
        manifest = manifest or load_manifest(Path(rank0))
        if manifest.rank != 0 or manifest.ranks != len(workers) + 1:
            raise ShardError(f"{rank0} is rank {manifest.rank} of {manifest.ranks}: a rank chain runs rank 0 here "
                             f"and one worker for each other rank ({len(workers)} given)")
        self.remotes: list[RemoteChain] = []
        self.mesh = None
        self.manifest = manifest
        self.spec = manifest.spec
        self.access, self._connect_timeout_s = access, connect_timeout_s
        try:
            for address in workers:
                self.remotes.append(RemoteChain(rank0, [address], access=access, shard=shard,
                                                connect_timeout_s=connect_timeout_s, fed=True))
            self.mesh = Mesh.dial(self._mesh_addresses(), access.key, manifest.fingerprint, manifest.ranks,
                                  timeout_s=connect_timeout_s, tls=access.tls)
            self._meshed = [remote.connections for remote in self.remotes]  # the connections the mesh went with
            self.local = LocalChain([rank0], shard.device, compile_config(shard.mode, shard.precision), paged=False,
                                    mesh=self.mesh)
        except BaseException:
            self.close()
            raise
        self.turns = self.local.turns

    def _mesh_addresses(self) -> dict[int, str]:
        """Each other rank's mesh port, as its worker names it in its PONG."""
        addresses = {}
        for rank, remote in enumerate(self.remotes, start=1):
            held = remote.stages[0] if remote.stages else {}
            if held.get("rank") != rank or not held.get("mesh"):
                raise ShardError(f"the worker at {remote.first_address} serves rank {held.get('rank')}, "
                                 f"expected rank {rank}")
            addresses[rank] = f"{parse_address(remote.first_address)[0]}:{held['mesh']}"
        return addresses

    @property
    def first_folder(self) -> Path:
        return self.local.first_folder

    def reset(self, stream: int = 0) -> None:
        for remote in self.remotes:
            remote.reset(stream)  # reconnects a worker that broke off
        connections = [remote.connections for remote in self.remotes]
        if self.mesh.failure is not None or connections != self._meshed:  # the ranks meet on new links
            self.mesh.redial(self._mesh_addresses(), self.access.key, self.manifest.fingerprint,
                             timeout_s=self._connect_timeout_s, tls=self.access.tls)
            self._meshed = connections
        self.local.reset(stream)

    def keep(self, stream: int, slots: np.ndarray) -> None:
        for remote in self.remotes:
            remote.keep(stream, slots)
        self.local.keep(stream, slots)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                flags: Flag = Flag.NONE, stream: int = 0) -> Output:
        rest = flags & Flag.ALL_POSITIONS  # the workers' own results are not used: only their top-1
        self.mesh.needs = flags & (Flag.LOGITS | Flag.PROBS | Flag.CANDIDATES)  # of the others' vocabulary
        rounds = [remote.submit(input_ids, attention_mask, position_ids, rest, stream) for remote in self.remotes]
        try:
            out = self.local.forward(input_ids, attention_mask, position_ids, flags, stream)
        except (RuntimeError, MeshError) as exc:  # an exchange failed inside the graph (through OpenVINO)
            failure = exc
        else:
            failure = None
        for remote, round_ in zip(self.remotes, rounds):
            remote.collect(round_)  # a rank whose worker died or went silent says so here, as a StageError
        if failure is not None:  # the workers answered, but rank 0 lost its exchange with one of them
            peers = ", ".join(link.peer for link in self.mesh.links.values())
            raise StageError(self.manifest.stage_index, peers, f"tensor-parallel exchange failed: {failure}")
        return out

    def submit(self, input_ids, attention_mask, position_ids, flags: Flag = Flag.NONE, stream: int = 0):
        return self.forward(input_ids, attention_mask, position_ids, flags, stream)

    def collect(self, ticket: Output) -> Output:
        return ticket

    def flush(self) -> None:
        """Nothing waits: ``submit`` runs the forward."""

    def first_ready(self, tickets: list) -> int:
        return 0

    def close(self) -> None:
        for remote in self.remotes:
            remote.close()
        if self.mesh is not None:
            self.mesh.close()
