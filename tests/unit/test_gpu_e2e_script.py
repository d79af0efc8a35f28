"""bench/gpu_e2e.sh and kvplane.bench.gpu_pd_bench's arguments, without vLLM or a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.bench.gpu_pd_bench import FULL, SMALL, parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_max_model_len_defaults_to_what_the_sweep_and_the_conversation_need() -> None:
    args = parse_args(["--out", "x", "--sizes", "2048,24576"])
    assert args.max_model_len >= 24576 + 16
    assert args.max_model_len % 1024 == 0
    small = parse_args(["--out", "x", "--sizes", "1024,2048"])
    assert FULL.e2e_tokens <= small.max_model_len < 24576


def test_small_runs_a_shorter_conversation_two_sizes_once() -> None:
    args = parse_args(["--out", "x", "--device", "cpu", "--small"])
    assert args.size_list == [1024, 2048]
    assert args.repeats == 1
    assert args.run_sizes.e2e_tokens < FULL.e2e_tokens
    assert args.max_model_len == 3072
    full = parse_args(["--out", "x"])
    assert full.size_list == list(FULL.sweep_sizes)
    assert full.repeats == FULL.repeats


def test_small_keeps_sizes_and_repeats_given_on_the_command_line() -> None:
    args = parse_args(["--out", "x", "--small", "--sizes", "1536", "--repeats", "2"])
    assert args.size_list == [1536]
    assert args.repeats == 2
    assert args.run_sizes == SMALL


def test_a_max_model_len_below_the_largest_size_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--sizes", "4096", "--max-model-len", "4096", "--skip-e2e"])
    assert "below the 4112 tokens this run needs" in capsys.readouterr().err


def test_engines_compare_in_float32_unless_told_otherwise() -> None:
    assert parse_args(["--out", "x"]).dtype == "float32"
    assert parse_args(["--out", "x", "--dtype", "bfloat16"]).dtype == "bfloat16"


def test_script_without_vllm_names_each_missing_piece_and_how_to_get_it(tmp_path: Path) -> None:
    # A PATH with the shell's tools but no etcd.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mkdir"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    result = subprocess.run(
        [
            str(bin_dir / "bash"),
            str(ROOT / "bench" / "gpu_e2e.sh"),
            str(tmp_path / "out"),
            str(tmp_path / "none"),
        ],
        env={**os.environ, "PYTHON": sys.executable, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot run here" in result.stderr
    assert "missing vllm -- vLLM 0.32 or 0.33: pip install -e '.[vllm]'" in result.stderr
    assert "missing etcd on PATH -- apt-get install etcd-server" in result.stderr
    assert "has no config.json" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_script_help_says_it_has_never_run_on_a_gpu_and_checks_nothing(flag: str, tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_e2e.sh"), flag],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "bench/gpu_e2e.sh OUT_DIR [MODEL_DIR]" in result.stdout
    assert "No GPU has been available to this project" in result.stdout
    assert "Its CUDA path has never run." in result.stdout
    assert "--device cpu --small" in result.stdout
    assert not any(tmp_path.iterdir())
