"""deploy/docker/Dockerfile, and the compose build targets in it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .report import ROOT, Report


def check_dockerfile(resolved_paths: list[Path], report: Report) -> None:
    """Parse with BuildKit's parser; build targets and COPY sources exist and are in the context."""
    import dockerfile

    path = ROOT / "deploy" / "docker" / "Dockerfile"
    try:
        commands = dockerfile.parse_file(str(path))
    except dockerfile.GoParseError as exc:
        report.check(False, "Dockerfile parses (BuildKit parser)", str(exc))
        return
    report.check(True, f"Dockerfile parses (BuildKit parser): {len(commands)} instructions")
    stages = [
        c.value[2] for c in commands if c.cmd == "FROM" and len(c.value) == 3 and c.value[1].upper() == "AS"
    ]
    report.check(len(stages) == len(set(stages)), f"Dockerfile stages are distinct: {', '.join(stages)}")

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def pattern_regex(pattern: str) -> re.Pattern[str]:
        out = (
            re.escape(pattern.strip("/"))
            .replace(r"\*\*", "\0")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        return re.compile(out.replace("\0", ".*") + "(/.*)?")

    def in_context(rel: str) -> bool:
        """.dockerignore semantics: the last matching pattern wins, "!" re-includes. A directory
        is judged by a file inside it."""
        probe = rel + "/x.py" if (ROOT / rel).is_dir() else rel
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            if pattern_regex(pattern.lstrip("!")).fullmatch(probe):
                included = negate
        return included

    for c in commands:
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                report.check((ROOT / src).exists(), f"Dockerfile COPY {src}: exists")
                report.check(in_context(src), f"Dockerfile COPY {src}: not excluded by .dockerignore")
    for resolved in resolved_paths:
        for name, svc in json.loads(resolved.read_text())["services"].items():
            build = svc.get("build")
            if build:
                report.check(
                    Path(build["dockerfile"]).name == "Dockerfile" and build.get("target") in stages,
                    f"compose {name}: build target {build.get('target')} is a Dockerfile stage",
                )
