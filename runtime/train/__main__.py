"""``python -m runtime.train``: the same as ``dcp-train``."""

from __future__ import annotations

import sys

from runtime.train import main

sys.exit(main())
