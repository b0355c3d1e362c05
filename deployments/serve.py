"""Serve the deployments of deployments/prefect.yaml from this one process, schedules included: one machine,
no work pool, no worker. Needs a Prefect server (`prefect server start`, then `PREFECT_API_URL`).

    python deployments/serve.py [--limit N]

Runs execute in subprocesses of this one, from this checkout: relative paths in parameters (the on-demand
deployment's bundled example) are relative to the repository root, as they are to a worker's clone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"


def schedule(entry: dict[str, Any]):
    """A `schedules:` entry of prefect.yaml (cron, interval in seconds, or rrule; timezone, active...)."""
    from prefect.schedules import Schedule

    entry = dict(entry)
    if isinstance(entry.get("interval"), int | float):
        entry["interval"] = datetime.timedelta(seconds=entry["interval"])
    return Schedule(**entry)


def runner_deployments(prefect_file: Path = PREFECT_FILE) -> list:
    """prefect.yaml's deployments as served ones: same flows, names, parameters, schedules, tags, description."""
    from prefect.deployments.runner import RunnerDeployment

    deployments = []
    for spec in yaml.safe_load(prefect_file.read_text())["deployments"]:
        # The same entrypoint file as a worker's (flows/tokenize_dataset.py:tokenize_dataset), relative to ROOT.
        deployments.append(RunnerDeployment.from_entrypoint(
            spec["entrypoint"], name=spec["name"], description=spec.get("description"), tags=spec.get("tags"),
            parameters=spec.get("parameters"),
            schedules=[schedule(s) for s in spec["schedules"]] if spec.get("schedules") else None,
        ))
    return deployments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # One tokenization already uses every core; more runs at once only share them. Later runs wait their turn.
    parser.add_argument("--limit", type=int, default=1, help="flow runs executed at once (default 1)")
    args = parser.parse_args(argv)

    os.chdir(ROOT)  # entrypoints and relative parameters resolve against the checkout, wherever we started
    sys.path.insert(0, str(ROOT))
    from prefect import serve

    # The schedule lives on the server, not in this process: while serve is stopped (a reboot, an upgrade),
    # runs keep being scheduled, show as Late in the UI, and run when serve is back, one at a time (after the
    # first, cache hits unless the data changed). Prefect's default, True, would pause the deployments on the
    # way out: the UI would show nothing wrong and the nights missed would be skipped.
    serve(*runner_deployments(), pause_on_shutdown=False, limit=args.limit)


if __name__ == "__main__":
    main()
