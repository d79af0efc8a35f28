"""Offline checks of kvplane's deployment artifacts, beyond what their schemas say.

The command line (see the package's docstring): `python -m deploy_checks compose|dockerfile|helm|mesh ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .chart_checks import check_helm
from .compose_checks import check_compose
from .dockerfile_checks import check_dockerfile
from .mesh_checks import check_mesh
from .report import Report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("compose").add_argument("resolved", type=Path)
    sub.add_parser("dockerfile").add_argument("resolved", type=Path, nargs="*")
    sub.add_parser("helm").add_argument("out", type=Path)
    sub.add_parser("mesh").add_argument("out", type=Path)
    args = parser.parse_args(argv)
    report = Report()
    if args.what == "compose":
        check_compose(args.resolved, report)
    elif args.what == "dockerfile":
        check_dockerfile(args.resolved, report)
    elif args.what == "helm":
        check_helm(args.out, report)
    else:
        check_mesh(args.out, report)
    return report.done(args.what)


if __name__ == "__main__":
    sys.exit(main())
