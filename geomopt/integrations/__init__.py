"""Integrations with training frameworks, each behind an optional extra; importing ``geomopt`` or
this package imports none of them.

:mod:`geomopt.integrations.torchtitan` (``pip install "geomopt[torchtitan]"``): torchtitan's
optimizer configuration naming a geomopt spec.
"""
