"""Where the shipped demo models live (a leaf: the CLI reads it without loading torch)."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo" / "target"
DEMO_DRAFT_DIR = DEMO_MODEL_DIR.parent / "draft"
DEMO_EAGLE_DIR = DEMO_MODEL_DIR.parent / "eagle"  # an EAGLE-1 head for the demo model
DEMO_MODEL_NAME = "updraft-demo"  # the name `updraft serve` gives it
