import sys

from updraft.cli import main

# Guarded: a tensor-parallel engine's spawned workers import this module again.
if __name__ == "__main__":
    sys.exit(main())
