"""vLLM's socket files go to a folder of the engine's own, not the shared temporary folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from longhorizon.actor.engines.vllm import rpc_sockets_in_a_folder_of_ours
from longhorizon.common.processes import remove_tied_folder


def test_processes_started_in_the_block_name_their_sockets_in_a_private_folder(monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with rpc_sockets_in_a_folder_of_ours() as folder:
        assert folder is not None and Path(folder).is_dir() and os.environ["VLLM_RPC_BASE_PATH"] == folder
        (Path(folder) / "a-socket").touch()  # what vLLM leaves there
    assert "VLLM_RPC_BASE_PATH" not in os.environ  # processes started later choose again
    assert Path(folder).is_dir()  # the engine's processes still use it until shutdown
    remove_tied_folder(folder)
    assert not Path(folder).exists()


def test_a_failed_start_removes_the_folder(monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with pytest.raises(RuntimeError, match="no engine"):
        with rpc_sockets_in_a_folder_of_ours() as folder:
            raise RuntimeError("no engine")
    assert not Path(folder).exists() and "VLLM_RPC_BASE_PATH" not in os.environ


def test_a_folder_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    with rpc_sockets_in_a_folder_of_ours() as folder:
        assert folder is None and os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)
