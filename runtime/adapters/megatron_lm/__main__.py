"""``python -m runtime.adapters.megatron_lm ... -- pretrain_gpt.py ...`` (``cli``)."""

import sys

from runtime.adapters.megatron_lm.cli import main

sys.exit(main())
