"""A shard transfer onto a nearly full disk (issue 82, point 6): a real small filesystem (tmpfs with a
size) holds the receiving agent's shard store.  A shard larger than the free space is refused before
a byte is sent, a disk that fills up during the transfer ends it with the partial files removed, both
in plain words naming the node, what was needed and what was free, and the deployment already running
on that node keeps answering.  Needs root to mount; skipped with the reason elsewhere."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess

import pytest
from fleet_support import agent_process, greedy

from engine.config import FleetAccess, ShardOptions
from engine.errors import FleetError
from engine.fleet.control import AgentError, ControlClient
from engine.fleet.deploy import LOCAL, deploy
from engine.fleet.shardstore import content_hash
from engine.fleet.span import StageSpan
from engine.fleetkey import create_key, load_key

NAMED = r"^node office-pc: not enough disk space for shard \w{12}: it needs [\d.]+ [kMG]?B more, " \
        r"and .+ has [\d.]+ [kMG]?B free\.? "


@contextlib.contextmanager
def small_filesystem(folder, size_bytes: int):
    """A tmpfs of ``size_bytes`` mounted at ``folder``; unmounted on the way out, also after a failure."""
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("needs root on Linux to mount a small filesystem for the agent's shard store")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _fill(mount, leave: int) -> None:
    """Fills the filesystem at ``mount`` until ``leave`` bytes stay free."""
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(mount / "filler", "ab") as f:
        f.write(b"\0" * max(0, free - leave))


def test_a_transfer_onto_a_full_disk_fails_plainly_and_the_old_deployment_serves(tiny_models, tiny_exports,
                                                                                  tmp_path):
    key_file = create_key(tmp_path / "fleet.key")
    key = load_key(key_file)
    home = tmp_path / "node"
    serving = tiny_exports["qwen2", "2"].folders[1]
    incoming = tiny_exports["llama", "2"].folders[1]
    room = _folder_bytes(serving) + 2 * _folder_bytes(incoming) + (1 << 20)
    with small_filesystem(home / "data" / "agent", room) as store, \
            agent_process(key_file, home, name="office-pc") as (_, address):
        stages = [StageSpan(LOCAL, "CPU", 0, 2), StageSpan(address, "CPU", 2, 4)]
        deployment, chain = deploy(str(tiny_models["qwen2"]), stages, access=FleetAccess(key),
                                   shard=ShardOptions(weights="f32"),
                                   folders=tiny_exports["qwen2", "2"].folders)
        try:
            before = greedy(chain)

            # 1. less free space than the shard needs: refused before a byte is sent
            _fill(store, _folder_bytes(incoming) // 2)
            with pytest.raises(FleetError) as refused:
                deploy(str(tiny_models["llama"]), stages, access=FleetAccess(key), shard=ShardOptions(weights="f32"),
                       folders=tiny_exports["llama", "2"].folders)
            text = str(refused.value)
            assert re.search(NAMED.replace("^", r"while sending part 2 of 2: "), text), text
            assert "Free up space on that computer" in text, text
            assert not list((store / "incoming").iterdir())
            assert greedy(chain) == before  # the old deployment keeps answering

            # 2. room when the transfer starts, filled by something else while it runs: ENOSPC
            # mid-transfer ends it, the partial files are removed, and the message says so
            (store / "filler").unlink()
            with ControlClient(address, FleetAccess(key)) as agent:
                def fill_once(progress):
                    if 0 < progress.bytes_done and not (store / "filler").exists():
                        _fill(store, 4096)

                with pytest.raises(AgentError) as full:
                    agent.send_shard(incoming, progress=fill_once, chunk_bytes=64 << 10)
                text = str(full.value)
                assert re.search(NAMED, text), text
                assert "partly received files were removed" in text, text
                assert not list((store / "incoming").iterdir())
                assert not agent.call("has_shard", hash=content_hash(incoming))["present"]
                assert agent.call("ping") == {}  # the control connection stays
            assert greedy(chain) == before

            # 3. with the space back, the same transfer goes through
            (store / "filler").unlink()
            with ControlClient(address, FleetAccess(key)) as agent:
                assert agent.send_shard(incoming)[1] is True
            assert greedy(chain) == before
        finally:
            chain.close()
            deployment.stop(FleetAccess(key))
