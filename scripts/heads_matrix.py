"""Every proposer whose model runs on every rank, in every layout and graph mode: the
cross-product that the test suite samples (``tests/test_heads_across_ranks.py`` runs
each proposer once per layout with auto graphs, and FULL, PIECEWISE and eager on PCP=2
for one head per attention kind). Each cell runs the suite's check: every step each
rank's target and proposer were handed equals one process's, greedy tokens equal no
speculation, acceptance per position equals one process's, and buffers never move.

    .venv/bin/python scripts/heads_matrix.py        # about 4 minutes on 2 cores
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.checkpoints import build_checkpoint
from tests.heads import Head, make_head
from tests.test_heads_across_ranks import (
    HEADS,
    LAYOUTS,
    assert_every_rank_runs_one_process_s_steps,
)
from updraft import WorkerPool

GRAPH_MODES = ("auto", "full", "piecewise", "eager")


def draft_pair(root: Path) -> Head:
    target = build_checkpoint("llama", root / "target", seed=0)
    draft = build_checkpoint("llama", root / "draft", seed=1)
    return Head(
        target,
        {"speculative_model": str(draft), "draft_tensor_parallel_size": 2},
        None,
        draft,
        None,
    )


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="updraft-heads-matrix-"))
    proposers = {kind: (make_head(kind, root / kind), "head") for kind in HEADS}
    proposers["draft model"] = (draft_pair(root / "draft"), "draft")
    pool = WorkerPool()
    failures, cells = [], 0
    try:
        for name, (proposer, runner) in proposers.items():
            layouts = [layout for layout in LAYOUTS if runner == "head" or "tp2" in layout]
            for layout in layouts:
                row = []
                for mode in GRAPH_MODES:
                    start = time.perf_counter()
                    try:
                        assert_every_rank_runs_one_process_s_steps(
                            proposer, runner, layout, pool, mode
                        )
                        row.append(f"{mode} ok ({time.perf_counter() - start:.0f} s)")
                    except Exception:  # every cell reports; the run goes on
                        failures.append((name, layout, mode, traceback.format_exc()))
                        row.append(f"{mode} FAILED")
                    cells += 1
                print(f"{name:>12} {layout:>9}: " + ", ".join(row), flush=True)
    finally:
        pool.close()
    for name, layout, mode, trace in failures:
        print(f"\n== {name} {layout} {mode}\n{trace}")
    print(f"{cells - len(failures)} of {cells} cells pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
