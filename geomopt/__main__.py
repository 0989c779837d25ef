"""``python -m geomopt``: the ``geomopt`` command (:mod:`geomopt.cli.main`)."""

import sys

from geomopt.cli.main import main

sys.exit(main())
