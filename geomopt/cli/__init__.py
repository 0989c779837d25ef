"""The ``geomopt`` command line: :mod:`.main` (lint, plan, explain, init, fmt, schema, rule),
:mod:`.demo`, :mod:`.bench`."""
