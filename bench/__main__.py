"""``python -m bench`` (``make report``): see :mod:`bench.report`."""

import sys

from bench.report import main

sys.exit(main())
