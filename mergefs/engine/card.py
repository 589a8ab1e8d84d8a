"""The merge's model card: the ``README.md`` mergekit writes into its output, and what only mergefs
knows about the merge (the budget, the bytes the plan reads, the error bound and the exact error,
the plan hash, how to replay it).

The front matter is mergekit's (``base_model``: the Hub ids among the models, ``library_name:
transformers``, ``tags: [mergekit, merge]``), so the Hub renders and indexes the card as it does
mergekit's; the sections mergekit writes come first, in its words. Models are listed in the
spec's order (mergekit lists them in the order of a Python set, which changes from run to run).
Pure: a function of the spec, the plan and the names given; no I/O. Any thread.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import yaml

from mergefs.core.sizes import human_bytes
from mergefs.methods.papers import reference_md
from mergefs.plan.planner import Plan
from mergefs.spec.model import Spec

#: the card's file name in a merge output (and in a mount)
CARD_NAME = "README.md"
#: the config's file name beside the card (mergekit's name)
CONFIG_COPY_NAME = "mergekit_config.yml"
UNTITLED = "Untitled Model (1)"  # mergekit's name for an output without one
MERGEKIT_URL = "https://github.com/cg123/mergekit"


def _hub_id(record: Any) -> str | None:
    """The Hub id of a recorded model reference (``{path: id, revision: ...}``), else None."""
    if isinstance(record, dict) and isinstance(record.get("path"), str):
        return record["path"]
    return None


def _model_refs(raw: Any) -> Iterator[Any]:
    """Every model reference a resolved spec holds, in the spec's order: base_model, then models
    (or slice and module sources), as recorded (a path, or a mapping for Hub ids and LoRA)."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            if key in ("base_model", "model") and value is not None:
                yield value
            elif key not in ("parameters", "tokenizer", "storage_options"):
                yield from _model_refs(value)
    elif isinstance(raw, list):
        for item in raw:
            yield from _model_refs(item)


def _parts(record: Any) -> tuple[str, str | None, str | None, str | None]:
    """(model text, its Hub id, LoRA text, its Hub id) of one recorded reference."""
    if isinstance(record, str):
        return record, None, None, None
    if isinstance(record, dict):
        if "lora" in record:
            model, model_id, _, _ = _parts(record.get("model"))
            lora, lora_id, _, _ = _parts(record.get("lora"))
            return model, model_id, lora, lora_id
        if "model" in record:  # {model: {path, revision}, resolved: ...}
            return _parts(record["model"])
        hub = _hub_id(record)
        if hub is not None:
            return hub, hub, None, None
    return str(record), None, None, None


def _local_relative(records: list[Any], spec_dir: str | None) -> list[Any]:
    """``records`` with local paths inside the spec's directory made relative to it, as such
    specs are usually written (a published card should not name the author's private
    directories); other paths as resolved (mergekit shows them as written)."""
    def fix(rec: Any) -> Any:
        if isinstance(rec, str) and spec_dir and os.path.isabs(rec) and "://" not in rec \
                and rec.startswith(spec_dir.rstrip(os.sep) + os.sep):
            return os.path.relpath(rec, spec_dir)
        if isinstance(rec, dict):
            return {k: (fix(v) if k in ("model", "lora") else v) for k, v in rec.items()}
        return rec
    return [fix(r) for r in records]


def _link(text: str, hub: str | None) -> str:
    return f"[{text}](https://huggingface.co/{hub})" if hub else text


def _ref_md(record: Any) -> str:
    model, hub, lora, lora_hub = _parts(record)
    text = _link(model, hub)
    if lora is not None:
        text += " + " + _link(lora, lora_hub)
    return text


def _key(record: Any) -> str:
    return yaml.safe_dump(record, sort_keys=True)


def _hub_ids(records: list[Any]) -> list[str]:
    out: list[str] = []
    for rec in records:
        _, model_id, _, lora_id = _parts(rec)
        out += [i for i in (model_id, lora_id) if i is not None and i not in out]
    return out


def _number(x: float | None) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.6g}"


def _share(part: float | None, whole: float | None) -> str:
    if part is None or not whole:
        return ""
    return f" ({100.0 * part / whole:.3g}% of the merge update)"


def _range(got: tuple[float, float, float] | None) -> str:
    if got is None:
        return ""
    low, high, prob = got
    return f"; within [{_number(low)}, {_number(high)}] with probability ≥ {prob:.0%}"


def mergefs_section(spec: Spec, plan: Plan, manifest: str | None) -> str:
    """What mergefs adds to the card: the plan's figures and how to check them."""
    budget = spec.budget.describe()
    full = plan.planned_bytes >= plan.total_expert_bytes or spec.budget.kind == "full"
    rows = [
        ("budget", f"{budget} ({human_bytes(plan.budget_bytes)} of "
                   f"{human_bytes(plan.total_expert_bytes)} of expert weights)"),
        ("expert bytes read (planned)", f"{human_bytes(plan.planned_bytes)} ({plan.planned_bytes:,} "
                                        "bytes)"),
        ("expert blocks read", f"{plan.blocks_read:,} of {plan.blocks_total:,} "
                               f"({plan.blocks_zero:,} unchanged from the base, never read)"),
    ]
    if plan.sidecar_bytes:
        rows.append(("of which delta sidecars", human_bytes(plan.sidecar_bytes)))
    if spec.is_additive:
        est = plan.estimated()
        rows.append(("error bound, ‖E‖ ≤ (tight)",
                     _number(plan.bound_tight) + _share(plan.bound_tight, plan.update_norm)
                     + (", the update estimated" if "update_norm" in est else "")))
        if "error_exact" in est:
            rows.append(("estimated error ‖E‖ (from sketches)", "≈ " + _number(plan.error_exact)
                         + _share(plan.error_exact, plan.update_norm)
                         + _range(plan.error_interval())))
        else:
            rows.append(("exact error ‖E‖", _number(plan.error_exact)
                         + _share(plan.error_exact, plan.update_norm)))
        if plan.bound_output_tight is not None:
            rows.append(("bound on the output bytes (rounding included)",
                         _number(plan.bound_output_tight)))
    else:
        rows.append(("error bound", f"none: {spec.method} is not additive (omitted blocks count "
                                    "as unchanged; exact at the full budget)"))
    rows.append(("plan hash", f"`{plan.plan_hash}`"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    exact = ("This is the full merge: every changed expert block was read, and the result is the "
             "merge mergekit computes in float32." if full else
             f"Expert blocks outside the {budget} budget were not read and count as unchanged "
             "from the base (the planner keeps the blocks that move the merge most per byte).")
    verify = (f"    mergefs replay {manifest}\n" if manifest else
              "    mergefs replay <the manifest recorded with this merge>\n")
    return ("## How mergefs made it\n\n"
            "Merged by [mergefs](https://pypi.org/project/mergefs/) from the configuration "
            f"above. {exact}\n\n| | |\n|---|---|\n{table}\n\n"
            "Every byte read and written is recorded in a manifest; to re-read the sources, "
            "check their hashes and re-merge bit for bit:\n\n" + verify)


def model_card(spec: Spec, plan: Plan, name: str, config_text: str | None,
               manifest: str | None = None) -> bytes:
    """README.md for a merge of ``spec`` under ``plan``. ``name``: the output directory's (or
    mountpoint's) base name, as mergekit names the card; ``config_text``: the configuration as
    the user wrote it (else the resolved spec); ``manifest``: the manifest to replay."""
    raw = dict(spec.raw)
    spec_dir = os.path.dirname(os.path.abspath(spec.source)) if spec.source != "<inline>" \
        else None
    records = _local_relative(list(_model_refs({k: v for k, v in raw.items()
                                                if k != "tokenizer"})), spec_dir)
    base_record = _local_relative([raw.get("base_model")], spec_dir)[0]
    # mergekit names no base for slerp ("curse my past self", mergekit/card.py): it lists it
    actual_base = None if spec.method == "slerp" else base_record
    base_text = f" using {_ref_md(actual_base)} as a base" if actual_base is not None else ""
    seen: set[str] = set()
    bullets = []
    for rec in records:
        k = _key(rec)
        if k in seen or (actual_base is not None and k == _key(actual_base)):
            seen.add(k)
            continue
        seen.add(k)
        bullets.append(f"* {_ref_md(rec)}")
    front = yaml.safe_dump({"base_model": _hub_ids(records), "library_name": "transformers",
                            "tags": ["mergekit", "merge"]}, sort_keys=True)
    if config_text is None:
        config_text = yaml.safe_dump(raw, sort_keys=False)
    text = (f"---\n{front}---\n# {name or UNTITLED}\n\n"
            "This is a merge of pre-trained language models created using "
            f"[mergekit]({MERGEKIT_URL})'s configuration language with mergefs.\n\n"
            "## Merge Details\n### Merge Method\n\n"
            f"This model was merged using the {reference_md(spec.method)} merge method"
            f"{base_text}.\n\n"
            "### Models Merged\n\nThe following models were included in the merge:\n"
            + "\n".join(bullets) + "\n\n"
            "### Configuration\n\n"
            "The following YAML configuration was used to produce this model:\n\n"
            f"```yaml\n{config_text.rstrip()}\n```\n\n"
            + mergefs_section(spec, plan, manifest))
    return text.encode()
