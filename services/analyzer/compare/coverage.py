"""How much of the reference a job compared, and the answer it may give.

A job that compared nothing has not shown that the device agrees: every
answer states its coverage, the reference's computed tensors (node outputs
other than constants, less those the user chose to skip) that were
compared, and below ``min_coverage`` (default one half) the job answers
"no answer" with the most likely reason instead of a verdict:

- the device sent nothing (an empty or unreadable dump directory);
- most device entries could not be read (a wrong dump format, a corrupt dump);
- most device names match no reference name (a renamed or converted graph,
  a dump of another model), with the closest reference names and an affix
  that would explain them;
- most tensors were skipped (shapes that differ: another model, or another
  input size);
- otherwise the device did not dump most of what the reference computes.

Outcome and exit status: ``pass`` (0) every compared node within tolerance
and coverage adequate; ``fail`` (1) failing nodes found; ``no_answer`` (3)
too little compared to answer. Bad input (2) never reaches a report: the
job is refused.
"""
from __future__ import annotations

import math
from collections import Counter

from layerdiff.common.errors import EXIT_FAIL, EXIT_NO_ANSWER, EXIT_PASS

MIN_COVERAGE_DEFAULT = 0.5
_EXAMPLES = 3


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %" if math.isfinite(x) else "n/a"


def _affix(pairs: list[tuple[str, str]]) -> str:
    """A prefix or suffix the device adds to (most of) the reference names."""
    found: Counter = Counter()
    for dev, ref in pairs:
        if dev != ref and dev.startswith(ref):
            found[("suffix", dev[len(ref):])] += 1
        elif dev != ref and dev.endswith(ref):
            found[("prefix", dev[:len(dev) - len(ref)])] += 1
    if not found:
        return ""
    (kind, text), n = found.most_common(1)[0]
    if n * 2 < len(pairs):
        return ""
    return f"the device names carry the {kind} {text!r}"


def assess(rep, sites: list, aligner, *, min_coverage: float | None = None, source: str = "",
           dump_path: str = "") -> dict:
    """The ``coverage`` section of summary.json."""
    floor = MIN_COVERAGE_DEFAULT if min_coverage is None else float(min_coverage)
    computed = [s for s in sites if not s.is_constant]
    fused = {s.tensor for s, _ in getattr(rep, "fused", [])}
    folded = {s.tensor for s, _ in getattr(rep, "folded", [])}
    # a tensor computed inside a device fusion cannot be dumped: the fusion's
    # output stands for it, so it is not expected; nor is one the device
    # folded into a constant
    expected = [s for s in computed if s.tensor not in rep.user_skipped and s.tensor not in fused
                and s.tensor not in folded]
    compared_tensors = {r.site.tensor for r in rep.rows}
    compared = sum(1 for s in expected if s.tensor in compared_tensors)
    ratio = compared / len(expected) if expected else math.nan
    adequate = compared > 0 and ratio >= floor
    unmatched = [name for name, _ in rep.invalid_out]
    out = {
        "reference_tensors": len(sites),
        "computed_tensors": len(computed),
        "skipped_by_options": sum(1 for s in computed if s.tensor in rep.user_skipped),
        "fused": len(fused),
        "folded": len(folded),
        "expected": len(expected),
        "compared": compared,
        "ratio": None if math.isnan(ratio) else round(ratio, 6),
        "min_coverage": floor,
        "adequate": adequate,
        "device_tensors": len(rep.device_names),
        "device_unreadable": len(rep.device_errors),
        "device_unmatched": len(unmatched),
        "device_attributed": len(getattr(rep, "attributed", [])),
        "unmatched_examples": [{"device": d, "closest": aligner.closest(d)} for d in unmatched[:_EXAMPLES]],
        "map_node_dict_unused": [{"reference": r, "device": d} for r, d in aligner.unused_map_entries()],
        "exclude_node_list_unknown": list(aligner.unknown_excludes),
        "skip_keys_unused": list(aligner.unused_skip_keys),
        "cause": "",
    }
    # the sentence every view of the job shows (terminal, report.html)
    out["text"] = (f"{compared} of {len(expected)} reference tensors compared ({_pct(ratio)}); "
                   + (f"{len(fused)} more computed inside fused device nodes; " if fused else "")
                   + (f"{len(folded)} folded into constants by the device; " if folded else "")
                   + f"{out['device_tensors']} device tensors, {out['device_unmatched']} matching no reference "
                   f"tensor, "
                   + (f"{out['device_attributed']} standing for a reference tensor without a comparison (INT8 "
                      "views, weight and input copies), " if out["device_attributed"] else "")
                   + f"{out['device_unreadable']} unreadable")
    if not adequate:
        out["cause"] = _cause(rep, out, aligner, source, dump_path, len(expected))
    return out


def unmatched_options(cov: dict) -> list[tuple[str, str]]:
    """What the options named and the job never met (options_unmatched.log)."""
    return ([(f"map_node_dict {e['reference']!r}", f"its device name {e['device']!r} matched no device tensor")
             for e in cov["map_node_dict_unused"]]
            + [(f"exclude_node_list {n!r}", "no such node or tensor in the reference model")
               for n in cov["exclude_node_list_unknown"]]
            + [(f"skip_keys {k!r}", "no reference node or tensor name contains it") for k in cov["skip_keys_unused"]])


def _cause(rep, cov: dict, aligner, source: str, dump_path: str, expected: int) -> str:
    where = f"the dump directory {dump_path!r}" if dump_path else "the device run"
    if expected == 0:
        return "the options skip every computed tensor of the reference (skip_keys, exclude_node_list)"
    n_dev = cov["device_tensors"]
    if n_dev == 0:
        if source == "dump":
            return (f"the device sent no tensors: {where} is empty, or holds no file the reader recognises "
                    "(check the path on the collector host and --dump-format)")
        return "the device run produced no tensors"
    if cov["device_unreadable"] * 2 >= n_dev:
        first = rep.device_errors[0]
        return (f"{cov['device_unreadable']} of {n_dev} device entries could not be read, e.g. {first[0]}: "
                f"{first[1]} (a wrong --dump-format, or a corrupt dump)")
    if cov["device_unmatched"] * 2 >= n_dev:
        pairs = []
        examples = []
        looked = rep.invalid_out[:50]
        for name, _ in looked:
            close = aligner.closest(name, 1)
            if close:
                pairs.append((name, close[0]))
        for e in cov["unmatched_examples"]:
            examples.append(f"{e['device']!r}" + (f" (closest reference name {e['closest'][0]!r})"
                                                  if e["closest"] else ""))
        text = (f"{cov['device_unmatched']} of {n_dev} device tensor names match no reference tensor, e.g. "
                + ", ".join(examples))
        affix = _affix(pairs)
        if affix:
            text += f"; {affix}: map the names with --map-node-dict"
        elif len(pairs) * 4 < len(looked):
            text += "; few device names resemble a reference name: is this a dump of another model?"
        else:
            text += "; map the names with --map-node-dict, unless the dump comes from another model"
        shapes = [n for n, r in rep.skipped if "differs from the reference" in r]
        if shapes:
            text += f" ({len(shapes)} names that do match have other shapes, e.g. {shapes[0]!r})"
        unused = cov["map_node_dict_unused"]
        if unused:
            text += (f"; {len(unused)} map_node_dict entries matched no device tensor "
                     f"(e.g. {unused[0]['reference']!r} -> {unused[0]['device']!r})")
        return text
    data_skips = [(n, r) for n, r in rep.skipped if n not in rep.user_skipped]
    if len(data_skips) * 2 >= expected:
        return (f"{len(data_skips)} tensors were skipped, e.g. {data_skips[0][0]}: {data_skips[0][1]} "
                "(see compare_skip.log)")
    return (f"{len(rep.not_dumped)} reference tensors were not dumped by the device (see compare_skip.log); "
            "pass --min-coverage to accept a partial dump")


def perf_only_outcome() -> dict:
    """A performance-only job compares nothing and is not asked to."""
    return {"status": "perf_only", "exit_status": EXIT_PASS, "reason": "performance data only"}


def outcome(rep, cov: dict, verdict: tuple[str, str] | None = None) -> dict:
    """What the job answers, and the exit status that says it: too little
    compared is no answer; otherwise the diagnosis decides (``verdict``:
    (status, reason) from verdicts.exit_of: "fail" where the headline names
    something to fix, "pass" where it does not, "no_answer" where failing
    nodes could not be judged)."""
    pct = _pct(cov["ratio"] if cov["ratio"] is not None else math.nan)
    counted = f"{cov['compared']} of {cov['expected']} reference tensors compared, {pct}"
    if not cov["adequate"]:
        return {"status": "no_answer", "exit_status": EXIT_NO_ANSWER,
                "reason": f"only {cov['compared']} of {cov['expected']} reference tensors could be compared "
                          f"({pct}, at least {_pct(cov['min_coverage'])} needed): {cov['cause']}"}
    if verdict is None:     # no diagnosis: the seed's statistic
        verdict = ("fail", "failing nodes found") if any(r.failed for r in rep.rows) else \
            ("pass", "every compared node is within tolerance")
    status, why = verdict
    code = {"fail": EXIT_FAIL, "pass": EXIT_PASS, "no_answer": EXIT_NO_ANSWER}[status]
    return {"status": status, "exit_status": code, "reason": f"{why} ({counted})"}
