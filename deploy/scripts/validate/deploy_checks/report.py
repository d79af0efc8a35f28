"""Where the artifacts are, and the report every check writes to."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
CHART = ROOT / "deploy" / "helm" / "kvplane"
COMPOSE_DIR = ROOT / "deploy" / "compose"
# Kubernetes versions the chart is validated against: its kubeVersion floor and the newest schemas.
KUBE_VERSIONS = ("1.29.0", "1.37.0")


class Report:
    """Collects check results; prints each as it comes."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        if ok:
            self.passed += 1
            print(f"ok   {what}")
        else:
            self.failures.append(what)
            print(f"FAIL {what}{': ' + detail if detail else ''}")
        return ok

    def note(self, what: str) -> None:
        print(f"note {what}")

    def done(self, name: str) -> int:
        print(f"{name}: {self.passed} passed, {len(self.failures)} failed")
        return 1 if self.failures else 0
