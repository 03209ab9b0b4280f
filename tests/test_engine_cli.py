"""`kvlab engine` dispatch and the simulator's flag validation (in-process, no servers)."""

from __future__ import annotations

import pytest

from kvlab.cli import main as kvlab_main
from kvlab.engine.cli import main


def test_engine_lists_backends_and_rejects_unknown(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "sim" in out and "vllm" in out
    assert main(["tgi"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_sim_help_documents_the_contract_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        kvlab_main(["engine", "sim", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--replicas", "--host", "--ports", "--kv-events-ports", "--no-kv-events", "--name", "--model",
                 "--tokenizer", "--profile", "--time-scale", "--block-size", "--num-blocks", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--seed", "--ready-file"):
        assert flag in out


@pytest.mark.parametrize("flags,message", [
    (["--profile", "tpu-giant"], "unknown latency profile"),
    (["--num-blocks", "10", "--max-model-len", "4096"], "exceeds the KV cache"),
    (["--replicas", "1", "--ports", "1,2"], "2 ports for 1 replicas"),
    (["--time-scale", "0"], "time-scale"),
])
def test_sim_bad_flags_exit_2_with_a_message(capsys, flags, message):
    assert main(["sim", *flags]) == 2
    assert message in capsys.readouterr().err
