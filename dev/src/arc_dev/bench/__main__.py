"""``python -m arc_dev.bench``: run every benchmark (``make bench``)."""

import sys

from arc_dev.bench import main

sys.exit(main())
