"""``python -m runtime.calibrate``: the same as ``dcp-calibrate``."""

from __future__ import annotations

import sys

from runtime.calibrate import main

sys.exit(main())
