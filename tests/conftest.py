"""Shared pytest set-up for the hstu_inductor tests.

Runs the same in one process and under pytest-xdist (``make test`` uses ``-n auto``): every
worker is its own process and loads this file (which sets ``TRITON_INTERPRET`` without CUDA)
before collecting, so the seeding fixture and the interpreter apply in each
worker.
"""
from __future__ import annotations

import functools
import os
import re
import sys

# Inductor's compile workers are separate Python processes, each importing torch: on a 2-core
# machine starting that pool costs more than the few small C++ kernels a test compiles. One
# in-process compile thread generates and checks the same code. Must precede ``import torch``
# (torch._inductor.config reads it once); an explicit setting in the environment wins.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The cost rule keeps stock Inductor's code for small CUDA graphs, i.e. for most GPU tests' sizes; they
# test the rewrites, so the rule is off for them (tests/test_cost_rule.py turns it on where it is tested).
os.environ.setdefault("HSTU_INDUCTOR_COST_RULE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels run under the interpreter. TRITON_INTERPRET is read when a
# kernel is *decorated*, i.e. when hstu_inductor.kernels is first imported; test modules outside
# tests/kernels (tests/distributed, collected first) import it before tests/kernels/conftest.py
# runs, so it is set here, before any test module is collected (else every interpreter test of
# that process fails with "Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Make ``import _helpers`` work however pytest was invoked (rootdir, -p, a single file, ...).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("TRITON_INTERPRET") == "1":
    import _triton_interp  # noqa: E402

    _triton_interp.install()  # about a fifth off the interpreter's time on our kernels (see the module)


def pytest_configure(config):
    # Under xdist, N workers each with an all-core intra-op pool would oversubscribe the CPU:
    # give each worker its share of the cores.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _gpu_tests_untuned(request):
    """GPU tests run the attention kernels' default config (one compile per kernel, not one per tuning config),
    unless HSTU_INDUCTOR_AUTOTUNE is set; the ``every_*config`` tests check each tuning config on its own."""
    if request.node.get_closest_marker("gpu") is None or "HSTU_INDUCTOR_AUTOTUNE" in os.environ:
        yield
        return
    from hstu_inductor import config

    with config.patch(autotune=False):
        yield


@pytest.fixture
def dispatch_choices(monkeypatch):
    """Per call of a cost-rule ``SizeDispatch`` (hstu_inductor/cost_rule.py): True when it ran stock Inductor's graph."""
    from hstu_inductor import cost_rule

    choices = []

    class Spy(cost_rule.SizeDispatch):
        def __call__(self, *args):
            choices.append(self.decision.per_call(args) < self.decision.threshold)
            return super().__call__(*args)

    monkeypatch.setattr(cost_rule, "SizeDispatch", Spy)
    return choices


@pytest.fixture(autouse=True)
def _seed_everything():
    """Fixed seeds for every test: fresh random inputs, reproducible failures."""
    torch.manual_seed(0)
    yield


# A module-scoped fixture (a compiled model, an exported package, a fresh-process run) is built
# once per process that runs its tests. Under xdist the default "load" scheduling spreads one file's
# tests over the workers and interleaves files, so such a fixture is built again and again. Test
# files that define one are therefore scheduled as one unit; every other test is its own unit, as
# with "load". (xdist's own ``--dist loadgroup`` drops its group marks silently on pytest 9.2:
# pytest-xdist issue #1386.) The decision is made on the controller, which sees only node ids,
# hence the look at the file's text.
_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](class|module|package)["']""")


@functools.lru_cache(maxsize=None)
def _file_shares_fixture(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return bool(_SHARED_SCOPE.search(f.read()))
    except OSError:
        return False


# Longest first: xdist hands out units in queue order, so a long unit picked up last leaves the
# other worker idle at the end (on 2 cores the tail was minutes). ``tests/durations.txt`` holds
# each test's measured seconds (refresh with ``make durations``); units are queued by their summed
# estimate, a test missing from the file counting ``_UNKNOWN_S``. Only the order changes.
_DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.txt")
_UNKNOWN_S = 1.0


def _load_durations() -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with open(_DURATIONS, encoding="utf-8") as f:
            for line in f:
                secs, _, nodeid = line.strip().partition(" ")
                if nodeid and not line.startswith("#"):
                    out[nodeid] = float(secs)
    except OSError:
        pass
    return out


@pytest.hookimpl(optionalhook=True)  # a hook of xdist: unknown (and unused) without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":  # an explicit --dist choice is left alone
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = str(config.rootpath)
    durations = _load_durations()

    class _SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _file_shares_fixture(os.path.join(root, path)) else nodeid

        def _assign_work_unit(self, node) -> None:
            # Called first once xdist has queued every unit: sort the queue then, costliest first
            # (sorted is stable: equal estimates keep collection order).
            if not getattr(self, "_longest_first", False):
                units = sorted(self.workqueue.items(),
                               key=lambda u: -sum(durations.get(n, _UNKNOWN_S) for n in u[1]))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._longest_first = True
            super()._assign_work_unit(node)

    return _SharedFixtureScheduling(config, log)


# ``make test-fast`` (the inner loop) leaves out the tests marked ``heavy``; ``make test`` and CI
# run them. Besides ``@pytest.mark.heavy`` on a test, these node-id prefixes are heavy: each costs
# tens of seconds on 2 cores (AOTI packages, fresh interpreters, whole-model Inductor compiles,
# recompiles under dynamic shapes, long interpreter sweeps); see ``--durations`` in the CI log.
HEAVY = (
    "tests/test_export.py",
    "tests/test_backend_registration.py::test_fresh_process",
    "tests/test_explain.py",
    "tests/test_backend_equivalence.py",
    "tests/test_backend_registration.py::test_mode_options_reach_inductor",
    "tests/test_ops_opcheck.py::test_attention_symbolic_L",
    "tests/test_ops_opcheck.py::test_delta_attention_symbolic_L",
    "tests/test_ops_opcheck.py::test_stu_ops_symbolic_L",
    "tests/patterns/test_attention_symbolic_n.py",
    "tests/patterns/test_attention_dynamic.py",
    "tests/patterns/test_attention_model.py",
    "tests/patterns/test_attention_delta.py::test_delta_export",
    "tests/patterns/test_attention_delta.py::test_delta_training_left_alone",
    "tests/patterns/test_attention_near_miss.py::test_nested_training_without_output_size",
    "tests/patterns/test_attention_spellings.py::test_training_matches_eager",
    "tests/patterns/test_blocks_model.py::TestReferenceModel",
    "tests/patterns/test_blocks_model.py::test_stu_layer_variants",
    "tests/patterns/test_blocks_output.py::TestOutputSpellings",
    "tests/patterns/test_blocks_output.py::TestOutputBackwardModes",
    "tests/patterns/test_blocks_output.py::TestOutputTrainingDropout::test_mask_values",
    "tests/patterns/test_blocks_preprocess.py::TestPreprocessSpellings",
    "tests/patterns/test_blocks_preprocess.py::TestPreprocessBackwardModes::test_recompute",
    "tests/patterns/test_canonicalize.py::test_training",
    "tests/kernels/test_attention_kernels.py::test_window_sweep_fwd_bwd",
    "tests/kernels/test_attention_kernels.py::test_target_sweep_fwd_bwd",
    "tests/kernels/test_attention_kernels.py::test_block_shapes_and_skipping_bounds",
    # spawned gloo process pairs (each imports torch and compiles the model on every rank)
    "tests/distributed/test_ddp_fsdp.py",
    "tests/patterns/test_production_sizes.py::test_public_style_stacks",
    "tests/patterns/test_production_sizes.py::test_real_compile_b16_n2048_equal_to_eager",
    "tests/patterns/test_attention_dynamic_true.py::test_dynamic_true_rewritten_and_equal",
    # opcheck's backward and delta sweeps and the hypothesis fuzzing (forward opcheck stays fast)
    "tests/test_ops_opcheck.py::test_opcheck_attention_bwd",
    "tests/test_ops_opcheck.py::test_opcheck_delta_attention",
    "tests/test_fuzz_backend.py",
    "tests/patterns/test_blocks_public_styles.py::TestPublicStyles::test_graph_break_in_every_layer",
    "tests/patterns/test_blocks_public_styles.py::TestPublicStyles::test_training_every_layer",
)


# Families of cases that vary one axis another test of the family already covers (spellings of one
# rewrite, mask options of one kernel, compile modes of one spelling): `make test` (CI, <= 8 min on 2 cores)
# runs every other case of each, in collection order from the first; the rest are marked ``slow`` and run
# with `make test-all`. Cases already marked ``slow`` by their file are left out of the count.
HALVED = (
    "tests/patterns/test_value_prover.py::test_rewritten_by_meaning",
    "tests/test_static_inputs.py::test_parameters_stay_static_inputs",
    "tests/distributed/test_ddp_fsdp.py::test_fsdp2_every_block_rewritten_and_grads_equal",
    "tests/kernels/test_attention_kernels.py::test_block_shapes_and_skipping_bounds",
    "tests/kernels/test_attention_kernels.py::test_bwd_features_fp32",
    "tests/kernels/test_attention_kernels.py::test_target_sweep_fwd_bwd",
    "tests/kernels/test_attention_kernels.py::test_window_sweep_fwd_bwd",
    "tests/kernels/test_attention_rab_kernels.py::test_bucket_map_equals_per_tile_buckets",
    "tests/kernels/test_attention_rab_kernels.py::test_table_bias_per_head",
    "tests/kernels/test_attention_rab_kernels.py::test_table_bias_ts_bounds",
    "tests/kernels/test_attention_rab_kernels.py::test_table_grads_through_dense_buffer",
    "tests/kernels/test_attention_tile_order.py::test_orders_agree",
    "tests/kernels/test_delta_split.py::test_fold_equals_reference",
    "tests/kernels/test_delta_split.py::test_plans_equal_reference",
    "tests/patterns/test_attention_delta.py::test_delta_export",
    "tests/patterns/test_attention_dynamic.py::test_dynamic_batch_and_length",
    "tests/patterns/test_attention_dynamic_true.py::test_dynamic_true_rewritten_and_equal",
    "tests/patterns/test_attention_rab.py::test_rab_rewritten_equal_to_eager",
    "tests/patterns/test_attention_rab.py::test_rab_tables_off_dense_equal_to_eager",
    "tests/patterns/test_attention_rab.py::test_rab_training_gradients_reach_tables",
    "tests/patterns/test_attention_rab.py::test_sla_every_config_rewritten",
    "tests/patterns/test_attention_rab.py::test_symbolic_max_len_equal_to_eager",
    "tests/patterns/test_attention_rab.py::test_value_level_proof_alone_equal_to_eager",
    "tests/patterns/test_attention_rab_tables.py::test_near_misses_stay_dense",
    "tests/patterns/test_attention_rab_tables.py::test_symbolic_max_len_tables_training",
    "tests/patterns/test_attention_rab_tables.py::test_tables_to_path_b_training",
    "tests/patterns/test_attention_spellings.py::test_inference_matches_eager",
    "tests/patterns/test_attention_spellings.py::test_training_matches_eager",
    "tests/patterns/test_attention_symbolic_n.py::test_symbolic_n_near_miss",
    "tests/patterns/test_attention_symbolic_n.py::test_symbolic_n_rewritten",
    "tests/patterns/test_batch_of_one.py::test_stu_layer_batch_of_one",
    "tests/patterns/test_blocks_model.py::test_stu_layer_variants",
    "tests/patterns/test_dataflow_and_constants.py::test_mask_constants_never_confused",
    "tests/patterns/test_dataflow_and_constants.py::test_window_300_dynamic_true_equal_to_eager",
    "tests/patterns/test_metamorphic.py::test_through_the_backend",
    "tests/patterns/test_spelling_grammar.py::test_fixed_sample",
    "tests/test_ops_opcheck.py::test_opcheck_attention",
    "tests/test_ops_opcheck.py::test_opcheck_attention_bwd",
    "tests/test_ops_opcheck.py::test_opcheck_delta_attention",
    "tests/test_ops_opcheck.py::test_opcheck_stu_output",
    "tests/test_ops_opcheck.py::test_opcheck_stu_output_bwd",
    "tests/test_ops_opcheck.py::test_opcheck_stu_preprocess_bwd",
    "tests/test_safety_net.py::test_loop_over_heads_with_boolean_mask_unpad_dynamic",
)


def _halve(items) -> None:
    slow = pytest.mark.slow
    seen: dict[str, int] = {}
    for item in items:
        family = item.nodeid.split("[", 1)[0]
        if family not in HALVED or item.get_closest_marker("slow") is not None:
            continue
        k = seen.get(family, 0)
        seen[family] = k + 1
        if k % 2:
            item.add_marker(slow)


def pytest_collection_modifyitems(config, items):
    """Tests under a ``HEAVY`` prefix get the ``heavy`` mark, every other case of a ``HALVED`` family
    ``slow``; ``@pytest.mark.gpu`` tests are skipped when CUDA is unavailable."""
    heavy = pytest.mark.heavy
    for item in items:
        if item.nodeid.startswith(HEAVY):
            item.add_marker(heavy)
    _halve(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
