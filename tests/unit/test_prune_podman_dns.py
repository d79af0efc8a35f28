"""The compose stage drops podman DNS records of containers and networks that are gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "scripts" / "prune_podman_dns.py"
LIVE = "a" * 64
DEAD = "b" * 64


def _prune(folder: Path, networks: list[str], containers: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(folder), "--networks", *networks, "--containers", *containers],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _dns_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "aardvark-dns"
    folder.mkdir()
    (folder / "aardvark.pid").write_text("4242")
    # A network gone with a container it still lists: this record made decode-engine resolve to
    # a dead address in the next stage's network, on the same subnet.
    (folder / "kvplane_kvplane").write_text(
        f"10.89.0.1\n{DEAD} 10.89.0.35  kvplane_sim-decode_1,sim-decode,decode-engine,bbbbbbbbbbbb\n"
    )
    (folder / "kvplane-vllm-stage_kvplane").write_text(
        "10.89.0.1\n"
        f"{LIVE} 10.89.0.12  kvplane-vllm-stage_vllm-decode_1,vllm-decode,decode-engine,aaaaaaaaaaaa\n"
        f"{DEAD} 10.89.0.13  kvplane-vllm-stage_gateway_1,gateway,bbbbbbbbbbbb\n"
    )
    return folder


def test_a_gone_network_loses_its_file_and_a_gone_container_its_line(tmp_path: Path) -> None:
    folder = _dns_folder(tmp_path)

    out = _prune(folder, ["podman", "kvplane-vllm-stage_kvplane"], [LIVE])

    assert sorted(p.name for p in folder.iterdir()) == ["aardvark.pid", "kvplane-vllm-stage_kvplane"]
    assert (folder / "kvplane-vllm-stage_kvplane").read_text() == (
        "10.89.0.1\n"
        f"{LIVE} 10.89.0.12  kvplane-vllm-stage_vllm-decode_1,vllm-decode,decode-engine,aaaaaaaaaaaa\n"
    )
    assert (folder / "aardvark.pid").read_text() == "4242"
    dropped = out.splitlines()
    assert len(dropped) == 3
    assert any("kvplane_kvplane" in line and "10.89.0.35" in line for line in dropped)
    assert any("kvplane-vllm-stage_kvplane" in line and "10.89.0.13" in line for line in dropped)
    assert any("kvplane_kvplane: network gone" in line for line in dropped)


def test_records_of_live_containers_and_networks_are_left_as_they_are(tmp_path: Path) -> None:
    folder = _dns_folder(tmp_path)
    before = {p.name: p.read_text() for p in folder.iterdir()}

    out = _prune(folder, ["kvplane_kvplane", "kvplane-vllm-stage_kvplane"], [LIVE, DEAD])

    assert out == ""
    assert {p.name: p.read_text() for p in folder.iterdir()} == before


def test_a_missing_folder_is_nothing_to_prune(tmp_path: Path) -> None:
    assert _prune(tmp_path / "absent", [], []) == ""
