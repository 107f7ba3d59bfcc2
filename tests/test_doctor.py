"""``updraft doctor`` says healthy when replay agrees with eager, and names the
problem when a refresh is skipped."""

from __future__ import annotations

from updraft.cli import main
from updraft.demo import DEMO_DRAFT_DIR
from updraft.graph.static_input import StaticInput


def test_doctor_reports_a_healthy_demo_model(capsys):
    assert main(["doctor", "--capture-sizes", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "greedy outputs: identical" in out
    assert "replays checked against eager, ok" in out
    assert out.strip().endswith("healthy")


def test_doctor_fails_when_a_refresh_is_skipped(capsys, monkeypatch):
    refresh = StaticInput.refresh

    def forgetful(self, values):
        if self.name != "block_table":
            refresh(self, values)

    monkeypatch.setattr(StaticInput, "refresh", forgetful)
    assert main(["doctor", "--capture-sizes", "1,2,4,8"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCHED" in out and "differs by" in out
    assert out.strip().endswith("UNHEALTHY")


def test_doctor_crosses_target_and_draft_graphs(capsys):
    draft = str(DEMO_DRAFT_DIR)
    assert main(["doctor", "--speculative-model", draft, "--capture-sizes", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "accepted drafts per position" in line]
    assert len(rows) == 4 and len(set(rows)) == 1, out
    for name in ("target eager, draft eager", "target graph, draft graph"):
        assert name in out
    assert out.strip().endswith("healthy")
