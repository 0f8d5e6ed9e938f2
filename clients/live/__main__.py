"""``python -m clients.live``: see :mod:`clients.live.command`."""

import sys

from .command import main

sys.exit(main())
