"""``python -m shardkit.plan``."""

import sys

from shardkit.plan.cli import main

sys.exit(main())
