"""geomopt's shipped specs as torch optimizers: classes with torch's constructor signature
(``Cls(params, lr=..., weight_decay=..., implementation=...)``), registered as
``torch.testing._internal.common_optimizers.OptimizerInfo`` entries with their own
``optim_inputs`` functions, and the table of PyTorch's generic optimizer checks
(``TestOptimRenewed`` in PyTorch's test/test_optim.py): each is run by a test of
tests/test_torch_generic.py, or not applicable for the reason given. docs/guide/torch-contract.md
shows the same table (tests/test_torch_generic.py checks that it does)."""

from __future__ import annotations

import sys
import types
import unittest
import warnings


import geomopt
from torch.optim.lr_scheduler import StepLR

from geomopt.lint.coverage import UnusedRuleWarning
from geomopt.optim.contract.torch_api import GeneratedNamesWarning

try:  # torch's internal test helpers import expecttest (a test-only package) for their TestCase base
    import expecttest  # noqa: F401
except ImportError:  # only OptimizerInfo / OptimizerInput are used here, which do not need it
    sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)  # type: ignore[assignment]

from torch.testing._internal.common_optimizers import OptimizerInfo, OptimizerInput  # noqa: E402


class _Shipped(geomopt.GeomOptimizer):
    """A shipped spec behind torch's constructor. Plain tensors are named ``param.<i>`` and their
    roles guessed from shapes (a matrix is a hidden matrix, a vector goes to the rest): the
    warnings that say so, and that rules without tensors optimize nothing, are expected here."""

    SPEC: object = ""

    def __init__(self, params, lr=None, weight_decay=None, implementation: str = "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GeneratedNamesWarning)
            warnings.simplefilter("ignore", UnusedRuleWarning)
            super().__init__(params, self.SPEC, lr=lr, weight_decay=weight_decay, implementation=implementation)


class GeomAdamW(_Shipped):
    SPEC = "adamw"


class GeomSGD(_Shipped):
    """sgd-momentum's rule with torch.optim.SGD's keywords for its direction (momentum 0: none)."""

    def __init__(self, params, lr=None, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=None,
                 implementation: str = "auto"):
        direction = ({"kind": "heavy_ball", "momentum": momentum, "dampening": dampening, "nesterov": nesterov}
                     if momentum else {"kind": "none"})
        self.SPEC = {"geomopt": 1, "name": "sgd-momentum", "defaults": {"lr": 0.01},
                     "rules": [{"name": "all", "match": "**", "geometry": {"kind": "euclidean"},
                                "direction": direction}]}
        super().__init__(params, lr=lr, weight_decay=weight_decay, implementation=implementation)


class GeomMuon(_Shipped):
    SPEC = "muon"


def _inputs(*kwargs: dict):
    def optim_inputs(device=None, dtype=None):
        return [OptimizerInput(params=None, kwargs=dict(k), desc=", ".join(f"{a}={b}" for a, b in k.items())
                               or "default") for k in kwargs]
    return optim_inputs


#: what each accepts: lr, weight_decay (decoupled, as torch's AdamW) and the implementation of the
#: elementwise path; no per-group options, maximize, amsgrad, differentiable, foreach=/fused=
GEOM_OPTIM_DB = [
    OptimizerInfo(GeomAdamW, optim_inputs_func=_inputs({}, {"lr": 0.01}, {"weight_decay": 0.1},
                                                       {"lr": 0.02, "weight_decay": 0.0}),
                  supported_impls=(), not_og_supported_flags=(), supports_param_groups=False,
                  supports_complex=True, supports_fused_on=("cpu", "cuda")),
    OptimizerInfo(GeomSGD, optim_inputs_func=_inputs({}, {"lr": 0.05}, {"weight_decay": 0.01}, {"momentum": 0.0},
                                                     {"dampening": 0.5}, {"nesterov": True}),
                  supported_impls=(), not_og_supported_flags=(), supports_param_groups=False,
                  supports_complex=True, supports_sparse=True,
                  metadata_for_sparse=({"lr": 4.8e-3, "momentum": 0.0},
                                       [lambda opt: StepLR(opt, gamma=0.99999, step_size=300)])),
    # like torch.optim.Muon: complex parameters refused (its hidden matrices' lmo needs a real SVD)
    OptimizerInfo(GeomMuon, optim_inputs_func=_inputs({}, {"lr": 0.05}, {"weight_decay": 0.0}),
                  supported_impls=(), not_og_supported_flags=(), supports_param_groups=False,
                  supports_complex=False),
]

#: PyTorch's generic CPU checks (TestOptimRenewed) → the test of tests/test_torch_generic.py that runs it
COVERED = {
    "test_optim_infos_do_not_specify_global_cliquey_kwargs": "test_optim_inputs_set_no_global_flags",
    "test_errors": "test_errors",
    "test_forloop_goes_right_direction": "test_goes_right_direction",
    "test_param_group_with_lrscheduler_goes_right_direction": "test_param_group_dicts_with_scheduler_go_right",
    "test_tensor_lr": "test_tensor_lr",
    "test_complex": "test_complex",
    "test_complex_2d": "test_complex_2d",
    "test_foreach_matches_forloop": "test_foreach_matches_fused_and_auto",
    "test_fused_matches_forloop": "test_foreach_matches_fused_and_auto",
    "test_step_is_noop_when_params_have_no_grad": "test_step_is_noop_without_grads",
    "test_step_is_noop_for_zero_grads": "test_step_is_noop_for_zero_grads",
    "test_optimizer_can_be_printed": "test_can_be_printed",
    "test_state_dict_deterministic": "test_state_dict_deterministic",
    "test_can_load_older_state_dict": "test_can_load_older_state_dict",
    "test_can_load_from_to_named_state_dict": "test_load_named_state_dict",
    "test_save_load_equality_with_weights_only": "test_save_load_weights_only",
    "test_load_nontensor_step": "test_load_nontensor_step",
    "test_state_dict_pre_hook": "test_state_dict_hooks",
    "test_state_dict_post_hook": "test_state_dict_hooks",
    "test_state_dict_pre_post_hook": "test_state_dict_hooks",
    "test_load_state_dict_pre_hook_and_prepend": "test_load_state_dict_pre_hook_and_prepend",
    "test_load_state_dict_post_hook": "test_load_state_dict_hooks_run_once_in_order",
    "test_load_state_dict_pre_post_hook": "test_load_state_dict_hooks_run_once_in_order",
    "test_step_pre_hook": "test_step_hooks",
    "test_step_post_hook": "test_step_hooks",
    "test_step_all_hooks": "test_step_all_hooks",
    "test_deepcopy_copies_all_public_attrs": "test_deepcopy_copies_all_public_attrs",
    "test_non_empty_state": "test_non_empty_state",
    "test_rosenbrock_sparse": "test_rosenbrock_sparse",
    "test_rosenbrock_sparse_with_lrsched": "test_rosenbrock_sparse",
    "test_duplicate_params_in_one_param_group": "test_duplicate_params_in_one_param_group",
}

#: PyTorch's generic checks that do not apply on CPU to geomopt, and why (shown in the docs)
NOT_APPLICABLE = {
    "test_param_groups_lr": "per-group options are refused: a param group is a spec rule, so a group's lr is "
                            "set on its rule (param-group dicts without options are accepted)",
    "test_param_groups_weight_decay": "per-group options are refused: weight_decay is set on the spec rule",
    "test_second_order_optims_return_consistent_types": "for optimizers that require a closure (LBFGS); "
                                                        "geomopt's closure is optional",
    "test_fused_error_on_params_on_meta": "there is no fused= flag: implementation='fused' uses torch's fused "
                                          "AdamW kernel where the device has one and foreach ops elsewhere",
    "test_fused_large_tensor": "needs 64 GB of memory (a 2^32-entry tensor)",
}

#: TestOptimRenewed's checks that run on CUDA only (tests/test_devices.py runs geomopt on CUDA where present)
CUDA_ONLY = (
    "test_forloop_goes_right_direction_multigpu", "test_mixed_device_dtype",
    "test_set_default_dtype_works_with_foreach",
    "test_foreach_large_tensor", "test_peak_memory_foreach", "test_fused_does_not_step_if_foundinf",
    "test_cpu_load_state_dict", "test_state_dict_with_cuda_params", "test_fused_cpu_matches_cuda",
    "test_defaults_changed_to_foreach",
)

#: torch keywords geomopt does not take, and why (shown in the docs)
KWARGS_NOT_APPLICABLE = {
    "maximize": "negate the loss",
    "amsgrad": "no spec geometry keeps the running maximum of the second moment",
    "differentiable": "the step runs under torch.no_grad (no higher-order gradients through it)",
    "foreach, fused": "implementation='auto' | 'fused' | 'foreach' chooses how the elementwise path runs",
}
