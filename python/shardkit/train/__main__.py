"""``python -m shardkit.train``."""

import sys

from shardkit.train.cli import main

sys.exit(main())
