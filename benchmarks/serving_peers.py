"""The serving benchmark against its peers: each server (vsurge's drivers, vLLM, llama.cpp) started in turn,
the same jobs with the same client, one table row each (peers.py finds and starts them)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, run as a script or via runpy

from serving_client import http_run  # noqa: E402
from serving_report import _fmt, summarize  # noqa: E402
from serving_workloads import Job  # noqa: E402


def _peers_module() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script or via runpy
    import peers

    return peers


def peers_run(args: argparse.Namespace, jobs: list[Job]) -> list[tuple[str, dict[str, Any] | None, str]]:
    """Each server in turn: start, wait for ready, the same jobs with the same client, stop. Table rows."""
    import copy
    import tempfile

    peers = _peers_module()
    log_dir = args.peers_log_dir or tempfile.mkdtemp(prefix="vsurge-peers-")
    rows: list[tuple[str, dict[str, Any] | None, str]] = []
    for peer in peers.discover(args, args.concurrency):
        if isinstance(peer, peers.Skipped):
            print(f"# {peer.name}: skipped: {peer.reason}", file=sys.stderr)
            rows.append((peer.name, None, f"skipped: {peer.reason}"))
            continue
        print(f"# {peer.name}: starting: {' '.join(peer.argv)}", file=sys.stderr)
        try:
            with peers.running(peer, log_dir, args.ready_timeout) as (_, ready_s):
                print(f"# {peer.name}: ready in {ready_s:.0f}s, running the workload", file=sys.stderr)
                run_args = copy.copy(args)
                run_args.base_url, run_args.model_name, run_args.api_key = peer.base_url, None, None
                results, duration = asyncio.run(http_run(run_args, jobs))
        except peers.PeerFailed as e:
            print(f"# {e}", file=sys.stderr)
            rows.append((peer.name, None, str(e).splitlines()[0][:200]))
            continue
        summary = summarize(results, duration)
        print(f"== {peer.name} ==\n{_fmt(summary)}", file=sys.stderr)
        note = f"ready in {ready_s:.0f}s"
        if summary["failed"]:
            note += f"; errors: {summary['errors'][:1]}"
        rows.append((peer.name, summary, note))
    return rows
