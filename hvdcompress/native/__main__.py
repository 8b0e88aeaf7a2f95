"""``python -m hvdcompress.native``: build the kernel library and report where it is."""

import sys

from . import main

sys.exit(main())
