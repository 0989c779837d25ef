"""The forward tracer: one forward of the model at the dispatcher, recording how each parameter is
consumed and what flows along the activations.

``forward`` runs it (:func:`~geomopt.compile.trace.forward.trace_model`), ``dispatch`` is the
dispatch mode, ``families`` the op families, ``ops`` its op tables and records, ``blocks`` the cuts
of a layer's output, ``meta`` the meta-device stand-ins, ``replay`` repeated blocks traced once and
``inputs`` the example inputs. It reads parameter names through :mod:`geomopt.compile.wrappers`
and nothing else of compile: roles read the trace, never the other way.
"""
