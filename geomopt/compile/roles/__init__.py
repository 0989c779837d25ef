"""Role inference: what each tensor does in its model, from a traced forward, the module tree, or
names and shapes, with the spec's ``roles:`` over it.

``types`` holds the records (:class:`~geomopt.compile.roles.types.Role`, the role names),
``structure`` what an ``auto`` view reads of a tensor, ``infer`` the module rules, ``guess`` roles
from names and shapes, ``traced`` roles from the trace (:mod:`geomopt.compile.trace`), and
``assign`` the overrides and the roles stored on each tensor. Nothing here imports matching's
owners, the plan or lint.
"""
