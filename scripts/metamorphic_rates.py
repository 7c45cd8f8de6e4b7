#!/usr/bin/env python
"""Measure whether the backend still rewrites models after semantics-preserving transformations.

    PYTHONPATH=$PWD .venv/bin/python scripts/metamorphic_rates.py --n 40 --seed 0 \\
        --modes compile_static,compile_dynamic,fake_static --transforms none,singles --combos 3 \\
        --models grammar --out /tmp/metamorphic

Runs every case (``--models``: grammar seeds ``--seed`` .. ``--seed + n - 1``, and/or the
GR/tzrec-style stacks of ``tests/patterns/public_style_models.py``) under every *variant* (a
``+``-joined list of transformations of ``hstu_inductor.testing.metamorphic.ALL``; ``none`` is the
untransformed baseline, ``singles`` every transformation alone, ``--combos K`` adds K random
combinations of 2-4 transformations drawn from ``--seed``) in every mode of ``--modes``. Writes
``OUT.json`` (every record) and ``OUT.md``: the rewrite rate per variant and mode (among the HSTU
cases the transformation changed), false positives, mismatches with eager, transformations that
changed nothing, declines that the baseline rewrote, and the most common decline reasons with an
example each. A model that raises is recorded (``outcome="error"``), never fatal.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import pathlib
import random
import sys
import time

from tqdm import tqdm

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from spelling_rates import _rate, reason_key  # noqa: E402  (one grouping of reasons for both scripts)

log = logging.getLogger("metamorphic_rates")


# ------------------------------------------------------------------------------------------------
# Public-style cases (GR / tzrec stacks, two layers)

# name: (PublicStyleLayer options, uses num_targets, uses a per-row attn_scale, expected HSTU)
PUBLIC = {
    "gr_targets_rowscale": (dict(style="gr"), True, True, True),
    "gr_window_context": (dict(style="gr", max_attn_len=-4, contextual=2), True, False, True),
    "gr_groupnorm_noconcat": (dict(style="gr", group_norm=True, concat=False, target_aware=False), False, True, True),
    "tzrec_targets_window_late_silu": (dict(style="tzrec", group_norm=True, max_attn_len=-4, late_silu=True),
                                       True, False, True),
    "tzrec_plain": (dict(style="tzrec", target_aware=False), False, False, True),
    "gr_targets_see_each_other": (dict(style="gr", targets_see_each_other=True), True, False, False),
}
PUBLIC_LAYERS = 2


def public_case(seed: int):
    """The public-style config ``seed % len(PUBLIC)`` as a ``metamorphic.Case`` (parameters from
    ``torch.manual_seed(seed)``; a negative ``max_attn_len`` means ``N // 4``)."""
    import torch
    from hstu_inductor.testing.metamorphic import Case

    sys.path.insert(0, str(ROOT / "tests" / "patterns"))
    from public_style_models import PublicStyleStack

    name = sorted(PUBLIC)[seed % len(PUBLIC)]
    opts, targets, rowscale, hstu = PUBLIC[name]

    class Closed(torch.nn.Module):
        """The stack with ``N`` a model constant (the public code passes it as an int argument)."""

        def __init__(self, N, H, D):
            super().__init__()
            kw = dict(opts)
            if kw.get("max_attn_len", 0) < 0:
                kw["max_attn_len"] = N // -kw["max_attn_len"]
            self.N = N
            self.stack = PublicStyleStack(PUBLIC_LAYERS, H * D, H, D, D, **kw)

        def forward(self, x, offsets, *rest):
            rest = list(rest)
            nt = rest.pop(0) if targets else None
            scale = rest.pop(0) if rowscale else None
            return self.stack(x, offsets, self.N, nt, scale)

    def inputs(B, N, H, D, lengths, seed, requires_grad=False):
        fake = torch._guards.detect_fake_mode() is not None
        g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
        L, E = sum(lengths), H * D
        off = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(B)], dtype=torch.int64)
        x = torch.empty(L, E) if fake else torch.randn(L, E, generator=g)
        out = [x.requires_grad_(requires_grad), off]
        if targets:
            out.append(torch.tensor([rng.randint(min(2, n), n) for n in lengths], dtype=torch.int64))
        if rowscale:
            out.append(torch.empty(L) if fake else torch.rand(L, generator=g) * 0.5 + 0.1)
        return tuple(out)

    return Case(name=f"public:{name}", seed=seed, expected_hstu=hstu, layers=PUBLIC_LAYERS,
                build=lambda N, H, D: Closed(N, H, D), inputs=inputs, choices={"public": name})


# ------------------------------------------------------------------------------------------------
# Variants

def variants(spec: str, combos: int, seed: int) -> list:
    """``spec``: comma-separated ``none`` / ``singles`` / ``a+b`` entries; then ``combos`` random
    combinations of 2-4 graph transformations (one may be sizes_coincide) drawn from ``seed``."""
    from hstu_inductor.testing.metamorphic import ALL

    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item == "singles":
            out += [(t,) for t in ALL]
        elif item == "none":
            out.append(())
        else:
            names = tuple(item.split("+"))
            unknown = set(names) - set(ALL)
            if unknown:
                raise SystemExit(f"unknown transformations {sorted(unknown)}; known: {list(ALL)}")
            out.append(names)
    rng = random.Random(f"combos:{seed}")
    for _ in range(combos):
        out.append(tuple(rng.sample(list(ALL), rng.randint(2, 4))))
    seen, unique = set(), []
    for v in out:
        if v not in seen:
            seen.add(v)
            unique.append(v)
    return unique


def vname(v) -> str:
    return "+".join(v) if v else "none"


# ------------------------------------------------------------------------------------------------
# Tables

def _applied(r) -> bool:
    """The transformations changed something (every one of a combination, for a fair rate)."""
    return all(r["changed"].get(t, 0) > 0 for t in r["transforms"])


def _row(v: str, m: str, rs: list) -> str:
    """One line of the per-variant table: the rate among the HSTU cases the variant changed."""
    app = [r for r in rs if _applied(r)]
    hstu = [r for r in app if r["expected_hstu"]]
    kept = sum(r["outcome"] == "near_miss_kept" for r in app if not r["expected_hstu"])
    near = sum(not r["expected_hstu"] for r in app)
    c = collections.Counter(r["outcome"] for r in hstu)
    cells = [v, m, _rate(c["rewritten"], len(hstu)), c["partial"], c["declined"], c["error"], len(rs) - len(app),
             _rate(kept, near), sum(r["outcome"] == "false_positive" for r in rs),
             sum(r["numeric_ok"] is False for r in rs), sum(bool(r["transform_errors"]) for r in rs),
             f"{sum(r['seconds'] for r in rs) / len(rs):.2f}"]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def tables(records: list, modes: list, names: list) -> str:
    lines = ["## Rewrite rate per variant and mode", "",
             "Rewritten (every attention layer) among the HSTU cases on which every transformation of the "
             "variant changed at least one site; `not applied`: cases where one changed nothing (a transformation "
             "that finds no site in a graph is listed, not counted in the rate).", "",
             "| variant | mode | rewritten / applied HSTU | partial | declined | errors | not applied | "
             "near misses kept / applied | false positives | mismatches | transform errors | s/model |",
             "|---" * 12 + "|"]
    for v in names:
        for m in modes:
            rs = [r for r in records if vname(r["transforms"]) == v and r["mode"] == m]
            if rs:
                lines.append(_row(v, m, rs))
    lines += ["", "## Rate per transformation (all modes; cases where it changed a site, alone or in a combination)",
              "", "| transformation | alone: rewritten / applied HSTU | in combinations | sites changed per applied "
              "case |", "|---|---|---|---|"]
    from hstu_inductor.testing.metamorphic import ALL
    for t in ALL:
        alone = [r for r in records if tuple(r["transforms"]) == (t,) and r["expected_hstu"] and _applied(r)]
        combo = [r for r in records if t in r["transforms"] and len(r["transforms"]) > 1 and r["expected_hstu"]
                 and _applied(r)]
        changed = [r["changed"].get(t, 0) for r in records if r["changed"].get(t, 0) > 0]
        lines.append(f"| {t} | {_rate(sum(r['outcome'] == 'rewritten' for r in alone), len(alone))} | "
                     f"{_rate(sum(r['outcome'] == 'rewritten' for r in combo), len(combo))} | "
                     f"{sum(changed) / len(changed) if changed else 0:.1f} |")
    for title, pick in (("False positives (near misses rewritten)", lambda r: r["outcome"] == "false_positive"),
                        ("Numeric mismatches with eager", lambda r: r["numeric_ok"] is False),
                        ("Errors", lambda r: r["outcome"] == "error"),
                        ("Transformation errors (the transformation raised; the run went on without it)",
                         lambda r: bool(r["transform_errors"]))):
        bad = [r for r in records if pick(r)]
        lines += ["", f"## {title}: {len(bad)}", ""]
        lines += [f"- {r['case']} {r['mode']} {vname(r['transforms'])}: {r['outcome']}, attention "
                  f"{r['counts'].get('attention', 0)}, err {r['numeric_err']} {(r['error'] or '')[:200]} "
                  f"{r['transform_errors'][:2]} sites: {'; '.join(r['sites'][:6])[:400]}" for r in bad[:20]]
    lines += _not_applied(records, names)
    lines += _regressions(records)
    lines += _reasons(records, modes)
    return "\n".join(lines)


def _not_applied(records, names) -> list:
    """Per transformation: cases (all modes) where it found no site to change."""
    from hstu_inductor.testing.metamorphic import ALL

    lines = ["", "## Transformations that changed nothing (cases, all modes; an example each)", "",
             "| transformation | runs with it | changed nothing | example |", "|---|---|---|---|"]
    for t in ALL:
        rs = [r for r in records if t in r["transforms"]]
        none = [r for r in rs if r["changed"].get(t, 0) == 0]
        ex = f"{none[0]['case']} {none[0]['mode']}" if none else ""
        lines.append(f"| {t} | {len(rs)} | {len(none)} | {ex} |")
    return lines


def _regressions(records) -> list:
    """HSTU cases the baseline rewrote in a mode but a variant did not: what each transformation
    costs, case by case."""
    base = {(r["case"], r["mode"]): r["outcome"] for r in records if not r["transforms"]}
    lost = [r for r in records if r["transforms"] and r["expected_hstu"] and r["outcome"] != "rewritten"
            and base.get((r["case"], r["mode"])) == "rewritten"]
    lines = ["", f"## Declines the untransformed baseline rewrote: {len(lost)}", "",
             "| variant | mode | lost | example case |", "|---|---|---|---|"]
    groups = collections.defaultdict(list)
    for r in lost:
        groups[(vname(r["transforms"]), r["mode"])].append(r)
    for (v, m), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"| {v} | {m} | {len(rs)} | {rs[0]['case']} |")
    return lines


def _reasons(records, modes) -> list:
    lines = ["", "## Most common decline reasons of HSTU cases (reason as reported, one example each)", "",
             "| count | variants (count) | example: case, mode, variant | reason (verbatim) |", "|---|---|---|---|"]
    groups = collections.defaultdict(list)
    for r in records:
        if r["expected_hstu"] and r["outcome"] != "rewritten":
            reason = r["reasons"][0] if r["reasons"] else "no attention candidate reported"
            groups[reason_key(reason)].append((r, reason))
    for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:15]:
        r, reason = items[0]
        by_variant = collections.Counter(vname(x["transforms"]) for x, _ in items)
        vs = ", ".join(f"{v} ({k})" for v, k in by_variant.most_common(4))
        lines.append(f"| {len(items)} | {vs} | {r['case']}, {r['mode']}, {vname(r['transforms'])} | "
                     f"{reason[:300].replace('|', '/')} |")
    return lines


# ------------------------------------------------------------------------------------------------

def _tables_only(args) -> int:
    """``OUT.md`` again from saved records (after a change of the tables, without re-running)."""
    records = json.loads(pathlib.Path(args.tables_from).read_text())
    modes = list(dict.fromkeys(r["mode"] for r in records))
    names = list(dict.fromkeys(vname(r["transforms"]) for r in records))
    md = f"# Metamorphic rates\n\nTables of `{args.tables_from}` ({len(records)} records).\n\n" + \
        tables(records, modes, names)
    pathlib.Path(args.out).with_suffix(".md").write_text(md)
    print(md)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=40, help="grammar cases (seeds --seed .. --seed + n - 1)")
    p.add_argument("--seed", type=int, default=0, help="first seed (also draws the combinations)")
    p.add_argument("--modes", default="compile_static,compile_dynamic,fake_static")
    p.add_argument("--transforms", default="none,singles",
                   help="comma-separated variants: none, singles, or a+b+... (names of metamorphic.ALL)")
    p.add_argument("--combos", type=int, default=3, help="random combinations of 2-4 transformations to add")
    p.add_argument("--models", default="grammar", help="grammar, public, or grammar,public")
    p.add_argument("--public-n", type=int, default=len(PUBLIC), help="public-style cases (configs cycle)")
    p.add_argument("--out", default="metamorphic_rates", help="output path prefix (.json and .md are added)")
    p.add_argument("--grads-every", type=int, default=0, help="gradient check on every k-th compile run (0: never)")
    p.add_argument("--tables-from", default=None, help="only rewrite OUT.md from the records of this JSON file")
    args = p.parse_args(argv)
    if args.tables_from:
        return _tables_only(args)
    from hstu_inductor.testing.metamorphic import MODES, grammar_case, run
    from hstu_inductor.testing.grammar_run import start_measurement, write_tables

    modes = start_measurement(p, args.modes, MODES, logging.ERROR)
    models = {m.strip() for m in args.models.split(",") if m.strip()}
    cases = []
    if "grammar" in models:
        cases += [grammar_case(args.seed + i) for i in range(args.n)]
    if "public" in models:
        cases += [public_case(args.seed + i) for i in range(args.public_n)]
    vs = variants(args.transforms, args.combos, args.seed)
    names = [vname(v) for v in vs]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records, start, k = [], time.time(), 0
    with tqdm(total=len(modes) * len(vs) * len(cases), file=sys.stderr) as bar:
        for mode in modes:
            for v in vs:
                bar.set_description(f"{mode} {vname(v)}"[:60])
                for case in cases:
                    grads = args.grads_every > 0 and k % args.grads_every == 0 and mode.startswith("compile")
                    k += 1
                    rec = run(case, v, mode, grads=grads).as_dict()
                    if rec["outcome"] != "error":
                        rec.pop("traceback")  # kept only where it explains something
                    records.append(rec)
                    if rec["outcome"] == "false_positive" or rec["numeric_ok"] is False:
                        log.warning("%s %s %s: %s (err %s)", case.name, mode, vname(v), rec["outcome"],
                                    rec["numeric_err"])
                    bar.update()
            out.with_suffix(".json").write_text(json.dumps(records, indent=1, default=str))
    md = (f"# Metamorphic rates\n\n`{' '.join(sys.argv)}`: {len(cases)} cases x {len(vs)} variants x "
          f"{len(modes)} modes, {time.time() - start:.0f} s in all.\n\nVariants: "
          + ", ".join(f"`{n}`" for n in names) + "\n\n" + tables(records, modes, names))
    write_tables(out, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
