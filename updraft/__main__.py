import sys

from updraft.cli import main

sys.exit(main())
