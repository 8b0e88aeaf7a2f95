"""``python -m hvdcompress.bench``: see ``hvdcompress.bench.cli``."""

import sys

from .cli import main

sys.exit(main(prog="python -m hvdcompress.bench"))
