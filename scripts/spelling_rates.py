#!/usr/bin/env python
"""Measure how many generated HSTU attention spellings the backend rewrites, per family and mode.

    .venv/bin/python scripts/spelling_rates.py --n 2000 --modes fake_static,compile_dynamic \\
        --seed 0 --out results/spelling_rates

Draws ``--n`` samples of ``hstu_inductor.testing.grammar`` (seeds ``--seed`` .. ``--seed + n - 1``)
and runs each in every mode of ``--modes`` (``hstu_inductor.testing.grammar_run.MODES``). Writes
``OUT.json`` (every record) and ``OUT.md`` (the tables): the rewrite rate of the HSTU samples per
mode and per family value, false positives (near misses rewritten), numeric mismatches with eager,
errors, and the most common decline reasons with an example seed each (reasons are grouped with
node names and numbers blanked; the example is verbatim). A model that raises is recorded
(``outcome="error"``), never fatal. Gradients are checked on every ``--grads-every``-th sample of
the compile modes (0: never).
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import pathlib
import re
import sys
import time

from tqdm import tqdm

log = logging.getLogger("spelling_rates")


def reason_key(reason: str) -> str:
    """A decline reason with node names, numbers and graph dumps blanked, for grouping."""
    r = re.sub(r"^[A-Za-z_][\w]*: ", "", reason)  # the anchor node's name
    r = re.sub(r"%?\b[a-z_]+_\d+\b", "<node>", r)
    r = re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", r)
    r = re.sub(r"\(args = .*", "(...)", r)
    return r[:160]


def _rate(k, n):
    return f"{k}/{n} ({100 * k / n:.0f}%)" if n else "-"


def _agreement(records: list, modes: list) -> list:
    """Seeds whose outcome (rewritten, partial, declined, near miss kept, ...) differs between modes:
    a model must get the same decision static, dynamic and exported."""
    by_seed = collections.defaultdict(dict)
    for r in records:
        by_seed[r["seed"]][r["mode"]] = r["outcome"]
    full = {s: o for s, o in by_seed.items() if set(o) == set(modes)}
    differ = {s: o for s, o in full.items() if len(set(o.values())) > 1}
    lines = ["", f"## Same decision in every mode: {len(full) - len(differ)}/{len(full)} seeds", ""]
    lines += [f"- seed {s}: " + ", ".join(f"{m} {o}" for m, o in sorted(outs.items())) for s, outs in sorted(differ.items())]
    return lines


def tables(records: list, modes: list) -> str:
    by_mode = {m: [r for r in records if r["mode"] == m] for m in modes}
    lines = ["## Per mode", "",
             "| mode | HSTU samples | rewritten (all layers) | partial | declined | errors | near misses | "
             "false positives | numeric mismatches | s/model |", "|---" * 10 + "|"]
    for m, rs in by_mode.items():
        hstu = [r for r in rs if r["expected_hstu"]]
        nm = [r for r in rs if not r["expected_hstu"]]
        c = collections.Counter(r["outcome"] for r in hstu)
        secs = sum(r["seconds"] for r in rs) / max(len(rs), 1)
        lines.append(f"| {m} | {len(hstu)} | {_rate(c['rewritten'], len(hstu))} | {c['partial']} | {c['declined']} | "
                     f"{c['error']} | {len(nm)} | {sum(r['outcome'] == 'false_positive' for r in nm)} | "
                     f"{sum(r['numeric_ok'] is False for r in rs)} | {secs:.2f} |")
    lines += ["", "## Rewrite rate of HSTU samples per family value (rewritten / HSTU samples with that value)", "",
              "| family | value | " + " | ".join(modes) + " |", "|---" * (2 + len(modes)) + "|"]
    fams = sorted({f for r in records for f in r["choices"] if f != "mutation"})
    for fam in fams:
        vals = sorted({str(r["choices"].get(fam)) for r in records if fam in r["choices"]})
        for v in vals:
            cells = []
            for m in modes:
                rs = [r for r in by_mode[m] if r["expected_hstu"] and str(r["choices"].get(fam)) == v]
                cells.append(_rate(sum(r["outcome"] == "rewritten" for r in rs), len(rs)))
            lines.append(f"| {fam} | {v} | " + " | ".join(cells) + " |")
    lines += ["", "## Near misses per mutation (kept / samples)", "", "| mutation | " + " | ".join(modes) + " |",
              "|---" * (1 + len(modes)) + "|"]
    for mut in sorted({r["choices"]["mutation"] for r in records} - {"none"}):
        cells = []
        for m in modes:
            rs = [r for r in by_mode[m] if r["choices"]["mutation"] == mut]
            cells.append(_rate(sum(r["outcome"] == "near_miss_kept" for r in rs), len(rs)))
        lines.append(f"| {mut} | " + " | ".join(cells) + " |")
    for title, pick in (("False positives (near misses rewritten)", lambda r: r["outcome"] == "false_positive"),
                        ("Numeric mismatches with eager", lambda r: r["numeric_ok"] is False)):
        bad = [r for r in records if pick(r)]
        lines += ["", f"## {title}: {len(bad)}", ""]
        lines += [f"- seed {r['seed']} {r['mode']}: err {r['numeric_err']}, grad {r['grad_err']}, "
                  f"{r['choices']}" for r in bad[:20]]
    lines += _agreement(records, modes)
    lines += ["", "## Most common decline reasons of HSTU samples (reason as reported, one example seed)", ""]
    for m, rs in by_mode.items():
        groups = collections.defaultdict(list)
        for r in rs:
            if r["expected_hstu"] and r["outcome"] != "rewritten":
                reason = r["reasons"][0] if r["reasons"] else "no attention candidate reported"
                groups[reason_key(reason)].append((r["seed"], reason))
        lines += [f"### {m}", "", "| count | example seed | reason (verbatim) |", "|---|---|---|"]
        for key, items in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:10]:
            seed, reason = items[0]
            lines.append(f"| {len(items)} | {seed} | {reason[:300].replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="samples per mode")
    p.add_argument("--modes", default="fake_static,fake_auto,compile_static,compile_dynamic")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--out", default="spelling_rates", help="output path prefix (.json and .md are added)")
    p.add_argument("--grads-every", type=int, default=10, help="gradient check on every k-th compile sample")
    args = p.parse_args(argv)
    from hstu_inductor.testing.grammar_run import MODES, run
    from hstu_inductor.testing.grammar_run import start_measurement, write_tables

    modes = start_measurement(p, args.modes, MODES)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records, start = [], time.time()
    for mode in modes:
        t0 = time.time()
        for i in tqdm(range(args.n), desc=mode, file=sys.stderr):
            seed = args.seed + i
            grads = args.grads_every > 0 and i % args.grads_every == 0 and mode.startswith("compile")
            rec = run(seed, mode, grads=grads).as_dict()
            records.append(rec)
            if rec["outcome"] == "false_positive" or rec["numeric_ok"] is False:
                log.warning("seed %d %s: %s (err %s)", seed, mode, rec["outcome"], rec["numeric_err"])
        log.info("%s: %d samples in %.0f s", mode, args.n, time.time() - t0)
        out.with_suffix(".json").write_text(json.dumps(records, indent=1, default=str))
    md = (f"# Spelling grammar rates\n\n`{' '.join(sys.argv)}`: {args.n} samples per mode, seeds "
          f"{args.seed}..{args.seed + args.n - 1}, {time.time() - start:.0f} s in all.\n\n" + tables(records, modes))
    write_tables(out, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
