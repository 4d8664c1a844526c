"""``python -m relayrl.cli ...``: the same as the ``relayrl`` command."""

import sys

from relayrl.cli import main

sys.exit(main())
