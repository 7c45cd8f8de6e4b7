"""``hstu_inductor.config`` is one table (``config.OPTIONS``): the cache key, the environment variables,
validation and docs/options.md all follow from it."""
from __future__ import annotations

import pathlib

import pytest
import torch

from hstu_inductor import config

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "options.md"
BY_NAME = {o.name: o for o in config.OPTIONS}


def _other(o: config.Option, value):
    """A valid value of ``o`` other than ``value``."""
    special = {"patterns": lambda v: {**v, "attention": not v["attention"]},
               "cost_rule_min_work": lambda v: {**v, "infer": v["infer"] + 1},
               "proof_budget_s": lambda v: v + 1,
               "bucket_map_mb": lambda v: v + 1, "table_grad_mb": lambda v: v + 1,
               "delta_config": lambda v: 0 if v is None else None}
    if o.name in special:
        return special[o.name](value)
    return next(a for a in o.allowed if a != value)


def test_every_option_is_an_attribute_in_the_snapshot():
    assert list(config.snapshot()) == [o.name for o in config.OPTIONS]
    for o in config.OPTIONS:
        assert o.doc and "\n" not in o.doc, o.name
        assert getattr(config, o.name) == config.snapshot()[o.name]
    config.validate()


def test_doc_is_up_to_date():
    assert DOC.read_text() == config.markdown(), (
        "docs/options.md is stale: python -c \"from hstu_inductor import config; "
        "print(config.markdown(), end='')\" > docs/options.md")


@pytest.mark.parametrize("name", [o.name for o in config.OPTIONS if o.codegen])
def test_codegen_option_changes_the_cache_key(name):
    base = config.cache_key()
    with config.patch(**{name: _other(BY_NAME[name], getattr(config, name))}):
        assert config.cache_key() != base
    assert config.cache_key() == base


@pytest.mark.parametrize("name", [o.name for o in config.OPTIONS if not o.codegen])
def test_other_option_leaves_the_cache_key(name):
    base = config.cache_key()
    with config.patch(**{name: _other(BY_NAME[name], getattr(config, name))}):
        assert config.cache_key() == base


def test_cache_key_ignores_dict_order():
    base = config.cache_key()
    with config.patch(cost_rule_min_work=dict(reversed(list(config.cost_rule_min_work.items())))):
        assert config.cache_key() == base


def test_inductor_cache_uuid_follows_the_kernel_switches():
    """The post-grad passes' uuid (Inductor's FX graph / AOTAutograd cache keys) holds cache_key()."""
    from hstu_inductor.patterns.pipeline import HSTULoweringAudit, cache_uuid

    base = cache_uuid()
    assert HSTULoweringAudit().uuid() == base
    for name in ("silu", "tile_order", "bwd_algo", "dq_mode", "autotune", "delta_config"):
        with config.patch(**{name: _other(BY_NAME[name], getattr(config, name))}):
            assert HSTULoweringAudit().uuid() != base, name
    with config.patch(fastlaunch=_other(BY_NAME["fastlaunch"], config.fastlaunch)):
        assert cache_uuid() == base


# One setting per variable, none of them the default; a new option needs its line.
ENV = {"tma": ("off", "off"), "kernels": ("off", "off"), "gluon": ("off", "off"),
       "deterministic": ("1", True), "block_backward": ("recompute", "recompute"), "fuse_u_silu": ("0", False),
       "specialize_features": ("0", False), "check_inputs": ("always", "always"),
       "capture_dynamic_shape_ops": ("0", False), "rab_tables": ("1", True), "lone_blocks": ("1", True), "cost_rule": ("off", "off"),
       "prover": ("probes", "probes"), "proof_budget_s": ("2.5", 2.5), "strict": ("1", True),
       "silu": ("packed", "packed"), "tile_order": ("block", "block"), "bwd_algo": ("atomic", "atomic"),
       "dq_mode": ("3", 3), "bucket_map_mb": ("0", 0.0), "table_grad_mb": ("0", 0.0), "autotune": ("0", False), "delta_config": ("2", 2), "fastlaunch": ("OFF", "off")}


def test_every_variable_has_a_case():
    assert set(ENV) == {o.name for o in config.OPTIONS if o.env}


@pytest.mark.parametrize("name", sorted(ENV))
def test_environment_variable_is_honoured(name, monkeypatch):
    o = BY_NAME[name]
    text, value = ENV[name]
    assert value != o.default
    monkeypatch.delenv(o.env, raising=False)
    assert config.read_env()[name] == o.default
    monkeypatch.setenv(o.env, text)
    got = config.read_env()[name]
    assert got == value and type(got) is type(value)
    assert o.valid(got)


@pytest.mark.parametrize("text,value", [("0", "off"), ("no", "off"), ("1", "on"), ("verify", "verify")])
def test_fastlaunch_spellings(text, value, monkeypatch):
    monkeypatch.setenv("HSTU_INDUCTOR_FASTLAUNCH", text)
    assert config.read_env()["fastlaunch"] == value


def test_autotune_only_zero_turns_it_off(monkeypatch):
    monkeypatch.setenv("HSTU_INDUCTOR_AUTOTUNE", "false")  # as before the table: anything but "0" is on
    assert config.read_env()["autotune"] is True


BAD = [(o.name, "bogus") for o in config.OPTIONS] + [
    ("deterministic", 1), ("dq_mode", True), ("dq_mode", 4), ("autotune", "0"), ("proof_budget_s", 0),
    ("proof_budget_s", True), ("patterns", {"attn": False}), ("patterns", {"attention": "no"}),
    ("cost_rule_min_work", {"infer": -1}), ("cost_rule_min_work", {"infer": 1, "train": 2, "eval": 3}),
    ("delta_config", "2"), ("tma", True)]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_value_raises_valueerror_naming_the_option(name, value):
    before = config.snapshot()
    with pytest.raises(ValueError, match=rf"hstu_inductor\.config\.{name}="):
        with config.patch(**{name: value}):
            pass
    assert config.snapshot() == before


def test_unknown_option_raises_attributeerror():
    with pytest.raises(AttributeError, match="no option"):
        with config.patch(not_an_option=1):
            pass


def test_bad_environment_text_is_named_when_read(monkeypatch):
    """Text that does not parse is kept, so the import never fails; the read names option and variable."""
    monkeypatch.setenv("HSTU_INDUCTOR_DQ_MODE", "two")
    values = config.read_env()
    assert values["dq_mode"] == "two"
    monkeypatch.setattr(config, "dq_mode", values["dq_mode"])
    with pytest.raises(ValueError, match="dq_mode.*HSTU_INDUCTOR_DQ_MODE"):
        config.get("dq_mode")
    with pytest.raises(ValueError, match="dq_mode"):
        config.validate()


def test_kernels_read_the_switches_through_config():
    from hstu_inductor.kernels import attention as K
    from hstu_inductor.kernels import delta

    with config.patch(tile_order="block"):
        assert not K._seq_major()
    assert K._seq_major() == (config.tile_order == "seq")
    with config.patch(delta_config=1):
        plan = delta._plan_for(16, torch.bfloat16, None, None)
    assert (plan.block_n, plan.stages, plan.warps) == delta._CONFIGS[1]
